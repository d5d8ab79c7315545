"""The decode paths built for CUDA: the static-shape step (checked on the CPU too) and, when a
CUDA device is present, bfloat16 weights, graph capture and parity with transformers on it.

`scripts/gpu-check` runs this file on a GPU machine; in CI only the CPU tests run.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.fast.cuda_graph import SPAN, StaticDecoder
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")
PROMPT_LEN, NEW_TOKENS = 20, 12
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompt(vocab: int, length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(1))


def _runner(folder, dtype=torch.float32, device=CPU) -> ModelRunner:
    return ModelRunner(load_model(folder, ModelConfig.from_file(folder), dtype, device))


def _decode(
    runner: ModelRunner, ids: torch.Tensor, steps: int, layout: str = "gqa"
) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy decode through `runner.new_cache`; every step's logits and the chosen tokens."""
    cache = runner.new_cache(ids.shape[0] + steps, layout=layout)
    logits = [runner.forward(ids, 0, cache)]
    tokens: list[int] = []
    for i in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.forward(torch.tensor([tokens[-1]], device=ids.device), ids.shape[0] + i, cache))
    assert cache.usage().tokens == ids.shape[0] + steps
    cache.release()
    return logits, tokens


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mqa", "qwen2", "qwen3", "llama3-rope"])
@pytest.mark.parametrize("layout", ["gqa", "mha"])
def test_static_step_matches_the_normal_path_on_cpu(tiny_models, name, layout):
    folder, _ = tiny_models[name]
    runner = _runner(folder)
    ids = _prompt(runner.model.cfg.vocab_size)
    eager_logits, eager_tokens = _decode(runner, ids, NEW_TOKENS, layout)
    runner.use_static_decode(True, capture=False)
    static_logits, static_tokens = _decode(runner, ids, NEW_TOKENS, layout)
    assert static_tokens == eager_tokens
    for eager, static in zip(eager_logits, static_logits, strict=True):
        assert torch.allclose(static, eager, atol=1e-5, rtol=0), (static - eager).abs().max()


def test_static_step_crosses_a_span_boundary_and_reuses_the_arena(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    runner = _runner(folder)
    ids = _prompt(runner.model.cfg.vocab_size, SPAN - 3)  # decode runs past position SPAN: a second window
    eager_logits, eager_tokens = _decode(runner, ids, 6)
    runner.use_static_decode(True, capture=False)
    decoder = runner.static_decoder
    for _ in range(2):  # the second request reuses the arena (stale K/V from the first is masked)
        static_logits, static_tokens = _decode(runner, ids, 6)
        assert static_tokens == eager_tokens
        assert max((a - b).abs().max().item() for a, b in zip(static_logits, eager_logits, strict=True)) < 1e-5
    assert decoder.capacity >= SPAN + 3


def test_arena_is_lent_to_one_cache_at_a_time(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    runner = _runner(folder)
    runner.use_static_decode(True, capture=False)
    first = runner.new_cache(40)
    second = runner.new_cache(40)
    assert first.borrowed and runner.static_decoder.serves(first)
    assert not second.borrowed  # the arena is out: the second request gets buffers of its own
    first.release()
    third = runner.new_cache(40)
    assert third.borrowed
    # Quantized storage never borrows: the static step writes the model's dtype only.
    third.release()
    fp8 = runner.new_cache(40, storage_dtype=torch.float8_e4m3fn)
    assert not fp8.borrowed


def test_borrowed_cache_accounts_like_its_own(tiny_models):
    folder, _ = tiny_models["qwen2"]
    runner = _runner(folder)
    cfg = runner.model.cfg
    ids = _prompt(cfg.vocab_size)
    own = KVCache(cfg, PROMPT_LEN + 5, device=CPU, compute_dtype=torch.float32)
    runner.use_static_decode(True, capture=False)
    lent = runner.new_cache(PROMPT_LEN + 5)
    for cache in (own, lent):
        runner.forward(ids, 0, cache)
        for i in range(5):
            runner.forward(torch.tensor([7]), PROMPT_LEN + i, cache)
    a, b = own.usage(), lent.usage()
    assert (a.tokens, a.logical_bytes, a.physical_bytes, a.per_layer_tokens) == (
        b.tokens,
        b.logical_bytes,
        b.physical_bytes,
        b.per_layer_tokens,
    )
    assert b.reserved_bytes == runner.static_decoder.arena_bytes  # what the arena really holds


def test_capture_refuses_a_cpu_model(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    cfg = ModelConfig.from_file(folder)
    model = load_model(folder, cfg, torch.float32, CPU)
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(model, capture=True)


# -- on a CUDA device (scripts/gpu-check) ------------------------------------------------------


def _cuda_runner(folder, dtype) -> tuple[ModelConfig, ModelRunner]:
    runner = _runner(folder, dtype, torch.device("cuda"))
    return runner.model.cfg, runner


@needs_cuda
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_cuda_float32_prefill_and_greedy_match_transformers(tiny_models, name):
    folder, hf = tiny_models[name]
    cfg, runner = _cuda_runner(folder, torch.float32)
    ids = _prompt(cfg.vocab_size).cuda()
    with torch.no_grad():
        ref_model = hf.to("cuda")
        ref_logits = ref_model(ids[None]).logits[0].float()
        ref_tokens = ref_model.generate(
            ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, PROMPT_LEN:].tolist()
        hf.to("cpu")
    cache = runner.new_cache(PROMPT_LEN)
    ours = runner.forward(ids, 0, cache, all_logits=True)
    cache.release()
    # TF32 or reduced-precision reductions may be on for matmuls on the GPU: a looser bound.
    assert torch.allclose(ours, ref_logits, atol=2e-3, rtol=0), (ours - ref_logits).abs().max()
    assert _decode(runner, ids, NEW_TOKENS)[1] == ref_tokens  # through the captured graph


@needs_cuda
@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "llama-mha-tied"])
def test_cuda_graph_matches_eager_in_bfloat16(tiny_models, name):
    folder, _ = tiny_models[name]
    cfg, runner = _cuda_runner(folder, torch.bfloat16)
    ids = _prompt(cfg.vocab_size).cuda()
    graph_logits, graph_tokens = _decode(runner, ids, NEW_TOKENS)
    assert runner.static_decoder is not None and runner.static_decoder.captures >= 1
    runner.use_static_decode(False)
    eager_logits, eager_tokens = _decode(runner, ids, NEW_TOKENS)
    assert graph_tokens == eager_tokens
    worst = max((a - b).abs().max().item() for a, b in zip(graph_logits, eager_logits, strict=True))
    assert worst < 0.1, worst  # bfloat16: the masked window rounds a little differently


@needs_cuda
@pytest.mark.slow
def test_cuda_default_model_greedy_matches_transformers(default_model_dir):
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig.from_file(default_model_dir)
    runner = ModelRunner(load_model(default_model_dir, cfg, torch.float32, torch.device("cuda")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).cuda().eval()
    ids = _prompt(cfg.vocab_size, 40).cuda()
    with torch.no_grad():
        ref = hf.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, 40:].tolist()
    assert _decode(runner, ids, 32)[1] == ref


@needs_cuda
def test_cuda_kv_bytes_match_the_allocator(tiny_models):
    folder, _ = tiny_models["llama-gqa"]
    cfg, runner = _cuda_runner(folder, torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = KVCache(cfg, 1000, device=torch.device("cuda"), compute_dtype=torch.bfloat16)
    allocated = torch.cuda.memory_allocated() - before
    assert allocated == cache.usage().reserved_bytes
    cache.release()


def _batched_greedy(runner: ModelRunner, prompts: list[torch.Tensor], steps: int) -> list[list[int]]:
    """Greedy decode of every prompt together, in the step loop's shared steps (one thread each)."""
    import threading

    from minengine.engine.step_loop import BatchLimits, StepLoop

    loop = StepLoop(runner, BatchLimits(max_num_seqs=len(prompts), max_num_batched_tokens=64), gather_s=0.05)
    caches = [runner.new_cache(p.shape[0] + steps) for p in prompts]  # the first may borrow the static arena
    members = [loop.join(c, threading.Event()) for c in caches]
    tokens: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        logits, _ = members[i].forward(tuple(prompts[i].tolist()), 0)
        for k in range(steps):
            tokens[i].append(int(logits.argmax()))
            logits, _ = members[i].forward((tokens[i][-1],), prompts[i].shape[0] + k)
        members[i].leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for c in caches:
        c.release()
    assert max(s.sequences for m in members for s in m.steps) > 1
    return tokens


def _device_cases() -> list:
    cases = [pytest.param(CPU, torch.float32, False, id="cpu-static-eager")]
    cases.append(pytest.param(torch.device("cuda"), torch.bfloat16, True, id="cuda-graphs", marks=needs_cuda))
    return cases


@pytest.mark.parametrize(("device", "dtype", "capture"), _device_cases())
@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_batched_steps_keep_each_sequence_s_greedy_tokens(tiny_models, name, device, dtype, capture):
    """A batch beside a request decoding in the static arena (graphs on CUDA): every sequence's
    greedy tokens equal its tokens decoded alone."""
    folder, _ = tiny_models[name]
    runner = _runner(folder, dtype, device)
    runner.use_static_decode(True, capture=capture)
    prompts = [_prompt(runner.model.cfg.vocab_size, n).to(device) for n in (20, 7, 33)]
    alone = [_decode(runner, p, NEW_TOKENS)[1] for p in prompts]
    assert _batched_greedy(runner, prompts, NEW_TOKENS) == alone


@pytest.mark.parametrize(("device", "dtype", "capture"), _device_cases())
def test_unsteered_requests_together_keep_their_tokens_alone(chatty_tiny_dir, device, dtype, capture):
    """Requests the engine samples in the step (as `reqscope serve` runs them), together on the
    device (CUDA graphs for a lone request there), get the tokens each gets steered and alone."""
    from concurrent_runs import run_all

    from minengine.engine.engine import Engine
    from minengine.engine.events import DoneEvent
    from minengine.engine.request import GenerationRequest
    from minengine.sampling.params import SamplingParams

    engine = Engine(chatty_tiny_dir, device=device.type, dtype=str(dtype).removeprefix("torch."),
                    kv_budget_bytes=64 << 20, prefix_cache=False, cuda_graph=capture)  # fmt: skip
    requests = [
        GenerationRequest.from_prompt(prompt, sampling=sampling, max_tokens=NEW_TOKENS, ignore_eos=True)
        for prompt, sampling in (
            ("Tell me about Kyoto", SamplingParams(temperature=0.0)),
            ("What is a KV cache?", SamplingParams(temperature=0.8, top_k=40, seed=5)),
            ("Name three hotels in Osaka", SamplingParams(temperature=0.0)),
        )
    ]
    alone = [next(e for e in engine.start(r) if isinstance(e, DoneEvent)).result.token_ids for r in requests]
    together = run_all(engine, requests, steered=False)
    assert [events[-1].result.token_ids for events in together] == alone
    assert engine.pool.held_bytes == 0 and engine.steps.running == 0
