"""The lean single-token decode step: bit for bit the general forward pass, on every family."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.kv.cache import KVCache
from minengine.model.transformer import Transformer

CPU = torch.device("cpu")
PROMPT, STEPS = 12, 6


def _load(folder, dtype=torch.float32):
    cfg = ModelConfig.from_file(folder)
    return cfg, Transformer.load(folder, cfg, dtype, CPU)


def _decode(model, cfg, *, lean: bool, **cache_options) -> list[torch.Tensor]:
    """Logits of a prefill and STEPS greedy decode steps, through the lean step or not."""
    serves = model.eager_decoder.serves
    if not lean:
        model.eager_decoder.serves = lambda cache, pos: False
    try:
        cache = KVCache(cfg, PROMPT + STEPS, device=CPU, compute_dtype=model.dtype, **cache_options)
        ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
        out = [model.forward(ids, 0, cache)]
        for step in range(STEPS):
            out.append(model.forward(out[-1].argmax().view(1), PROMPT + step, cache))
        return out
    finally:
        model.eager_decoder.serves = serves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_lean_step_is_bit_for_bit_the_general_one(tiny_models, name, dtype):
    cfg, model = _load(tiny_models[name][0], dtype)
    lean, general = _decode(model, cfg, lean=True), _decode(model, cfg, lean=False)
    for a, b in zip(lean, general, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options", [{"layout": "mha"}, {"storage_dtype": torch.bfloat16}, {"storage_dtype": torch.float8_e4m3fn}]
)
def test_caches_the_lean_step_cannot_serve_take_the_general_path(tiny_models, options):
    cfg, model = _load(tiny_models["llama-gqa"][0])
    cache = KVCache(cfg, 8, device=CPU, compute_dtype=torch.float32, **options)
    assert not model.eager_decoder.serves(cache, 0)
    lean, general = _decode(model, cfg, lean=True, **options), _decode(model, cfg, lean=False, **options)
    assert all(torch.equal(a, b) for a, b in zip(lean, general, strict=True))


def test_a_full_cache_grows_through_the_general_path(tiny_models):
    cfg, model = _load(tiny_models["llama-gqa"][0])
    cache = KVCache(cfg, 4, device=CPU, compute_dtype=torch.float32, block_size=4)
    logits = model.forward(torch.arange(3, 7), 0, cache)
    assert not model.eager_decoder.serves(cache, 4)
    model.forward(logits.argmax().view(1), 4, cache)  # past the reservation: the cache grows
    assert cache.capacity > 4 and cache.tokens == 5


def test_threads_decode_with_their_own_buffers(tiny_models):
    cfg, model = _load(tiny_models["llama-gqa"][0])
    expected = _decode(model, cfg, lean=True)
    results: list[list[torch.Tensor]] = []
    barrier = threading.Barrier(3)

    def work() -> None:
        barrier.wait()
        results.append(_decode(model, cfg, lean=True))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for run in results:
        assert all(torch.equal(a, b) for a, b in zip(run, expected, strict=True))
