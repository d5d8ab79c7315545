"""The lean single-token decode step: bit for bit the general forward pass, on every family."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import SPECS
from torch.overrides import TorchFunctionMode

from minengine.config import ModelConfig
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")
PROMPT, STEPS = 12, 6


def _load(folder, dtype=torch.float32) -> tuple[ModelConfig, ModelRunner]:
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, dtype, CPU))


def _decode(runner: ModelRunner, cfg, *, lean: bool, **cache_options) -> list[torch.Tensor]:
    """Logits of a prefill and STEPS greedy decode steps, through the runner (the lean step where
    it serves) or through the general path (`Transformer.forward`) alone."""
    forward = runner.forward if lean else runner.model.forward
    cache = KVCache(cfg, PROMPT + STEPS, device=CPU, compute_dtype=runner.model.dtype, **cache_options)
    ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    out = [forward(ids, 0, cache)]
    for step in range(STEPS):
        out.append(forward(out[-1].argmax().view(1), PROMPT + step, cache))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_lean_step_is_bit_for_bit_the_general_one(tiny_models, name, dtype):
    cfg, runner = _load(tiny_models[name][0], dtype)
    lean, general = _decode(runner, cfg, lean=True), _decode(runner, cfg, lean=False)
    for a, b in zip(lean, general, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options", [{"layout": "mha"}, {"storage_dtype": torch.bfloat16}, {"storage_dtype": torch.float8_e4m3fn}]
)
def test_caches_the_lean_step_cannot_serve_take_the_general_path(tiny_models, options):
    cfg, runner = _load(tiny_models["llama-gqa"][0])
    cache = KVCache(cfg, 8, device=CPU, compute_dtype=torch.float32, **options)
    assert not runner.eager_decoder.serves(cache, 0)
    lean, general = _decode(runner, cfg, lean=True, **options), _decode(runner, cfg, lean=False, **options)
    assert all(torch.equal(a, b) for a, b in zip(lean, general, strict=True))


def test_a_full_cache_grows_through_the_general_path(tiny_models):
    cfg, runner = _load(tiny_models["llama-gqa"][0])
    cache = KVCache(cfg, 4, device=CPU, compute_dtype=torch.float32, block_size=4)
    logits = runner.forward(torch.arange(3, 7), 0, cache)
    assert not runner.eager_decoder.serves(cache, 4)
    runner.forward(logits.argmax().view(1), 4, cache)  # past the reservation: the cache grows
    assert cache.capacity > 4 and cache.tokens == 5


def test_threads_decode_with_their_own_buffers(tiny_models):
    cfg, runner = _load(tiny_models["llama-gqa"][0])
    expected = _decode(runner, cfg, lean=True)
    results: list[list[torch.Tensor]] = []
    barrier = threading.Barrier(3)

    def work() -> None:
        barrier.wait()
        results.append(_decode(runner, cfg, lean=True))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for run in results:
        assert all(torch.equal(a, b) for a, b in zip(run, expected, strict=True))


class _TorchCalls(TorchFunctionMode):
    """Counts torch functions and tensor methods called (attribute reads such as `.shape` aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _calls_per_block(owner: object, name: str, forward, cache: KVCache, pos: int) -> list[int]:
    """Torch calls inside each block (`owner.name`: `Transformer.block`, or the lean step's
    `EagerDecoder._block`) of one single-token `forward` at `pos`."""
    counts = []
    block = getattr(owner, name)

    def counted(*args, **kwargs):
        with _TorchCalls() as count:
            x = block(*args, **kwargs)
        counts.append(count.calls)
        return x

    setattr(owner, name, counted)
    try:
        forward(torch.tensor([5]), pos, cache)
    finally:
        delattr(owner, name)
    return counts


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "qwen3"])
def test_the_lean_step_runs_a_third_fewer_operations_per_block(tiny_models, name):
    # The reason the lean step exists: the same block with scratch buffers, a slot write and
    # no view-making runs about two thirds of the general path's operations.
    cfg, runner = _load(tiny_models[name][0])
    cache = KVCache(cfg, 16, device=CPU, compute_dtype=torch.float32)
    runner.forward(torch.arange(3, 10), 0, cache)
    runner.forward(torch.tensor([5]), 7, cache)  # the thread's scratch buffers are made here
    assert runner.pick(torch.tensor([5]), 8, cache).path.name == "torch eager"
    lean = _calls_per_block(runner.eager_decoder, "_block", runner.forward, cache, 8)
    general = _calls_per_block(runner.model, "block", runner.model.forward, cache, 8)
    assert len(lean) == len(general) == cfg.num_hidden_layers
    assert max(lean) <= 0.7 * min(general), (lean, general)


def test_the_runner_picks_the_path_by_cache_and_token_count(tiny_models):
    cfg, runner = _load(tiny_models["llama-gqa"][0])
    taken: list[str] = []
    lean_step, general = runner.eager_decoder.step_blocks, runner.model.forward
    runner.eager_decoder.step_blocks = lambda *a, **k: taken.append("lean") or lean_step(*a, **k)
    runner.model.forward = lambda *a, **k: taken.append("general") or general(*a, **k)
    cache = runner.new_cache(16)
    assert runner.static_decoder is None and not cache.borrowed  # the CPU default
    runner.forward(torch.arange(3, 8), 0, cache)
    runner.forward(torch.tensor([5]), 5, cache)
    every = runner.forward(torch.tensor([6]), 6, cache, all_logits=True)
    assert every.shape == (1, cfg.vocab_size)  # all_logits keeps the position axis
    fp8 = runner.new_cache(16, storage_dtype=torch.float8_e4m3fn)
    runner.forward(torch.arange(3, 8), 0, fp8)
    runner.forward(torch.tensor([5]), 5, fp8)
    assert taken == ["general", "lean", "general", "general", "general"]
