"""Automatic prefix caching: chained block hashes, reuse with identical results in every family,
layout and storage, eviction within the KV budget, and the stage's event."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.engine.engine import Engine
from minengine.engine.events import AdmitEvent, DoneEvent, PrefillEvent, PrefixCacheEvent, PromptEvent, StageEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.scheduler import Scheduler
from minengine.errors import AdmissionError
from minengine.kv.block_pool import PREFIX, BlockFormat, BlockPool
from minengine.kv.cache import KVCache, KVSpan
from minengine.kv.prefix_cache import FreshBlocks, KVIdentity, PrefixCache, block_hashes
from minengine.sampling.params import SamplingParams
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from reqscope.wording import worded

GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
IDENTITY = KVIdentity("model-a", "float32", "cpu", "gqa", "float32", 16)
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
# A long system prompt and a question: several full blocks are shared between the two runs.
SYSTEM = (
    "You are a travel assistant for people who use wheelchairs. Answer with concrete, checked "
    "details: step-free entrances, lifts, accessible rooms and bathrooms, and how to get there. "
) * 3


def request(prompt: str = "Which hotels in Kyoto have roll-in showers?", **kwargs) -> GenerationRequest:
    kwargs.setdefault("sampling", GREEDY)
    kwargs.setdefault("max_tokens", 8)
    return GenerationRequest.from_prompt(prompt, system=kwargs.pop("system", SYSTEM), **kwargs)


def run(engine: Engine, req: GenerationRequest):
    events = list(engine.start(req))
    assert isinstance(events[-1], DoneEvent)
    result = events[-1].result
    assert result.error is None, result.error
    return events, result


def prefix_event(events) -> PrefixCacheEvent:
    return next(e for e in events if isinstance(e, PrefixCacheEvent))


def tokens(result) -> tuple[int, ...]:
    return result.token_ids


@pytest.fixture
def engine(chatty_tiny_dir):
    """A fresh engine over the chatty tiny model: its prefix cache starts empty."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20)


@pytest.fixture(scope="module")
def reference(chatty_tiny_dir):
    """The same model with no prefix cache: what every hit must reproduce."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20, prefix_cache=False)


# -- the hash ---------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_parent_and_cover_the_identity():
    ids = list(range(100, 164))  # four blocks of 16
    hashes = block_hashes(ids, IDENTITY, 4)
    assert hashes == block_hashes(ids, IDENTITY, 4) and len(set(hashes)) == 4
    # One token changed in block 1: block 0 is the same, block 1 and every block after differ.
    changed = block_hashes(ids[:20] + [7] + ids[21:], IDENTITY, 4)
    assert changed[0] == hashes[0] and all(a != b for a, b in zip(changed[1:], hashes[1:], strict=True))
    # The same tokens in block 2 under another parent are another block.
    assert block_hashes(ids[32:48], IDENTITY, 1)[0] != hashes[2]
    # Anything else that changes K/V starts another chain.
    for field, other in (("model", "model-b"), ("dtype", "bfloat16"), ("device", "cuda:0"), ("layout", "mha"),
                         ("storage_dtype", "float8_e4m3fn")):  # fmt: skip
        assert block_hashes(ids, dataclasses.replace(IDENTITY, **{field: other}), 4)[0] != hashes[0], field
    eight = dataclasses.replace(IDENTITY, block_size=8)
    assert block_hashes(ids, eight, 8)[1] != hashes[0]  # the same 16 tokens, as two blocks of 8
    with pytest.raises(ValueError, match="fewer than 5 full blocks"):
        block_hashes(ids, IDENTITY, 5)


# -- identical results ------------------------------------------------------------------------


def _runner(folder) -> ModelRunner:
    return ModelRunner(load_model(folder, ModelConfig.from_file(folder), torch.float32, CPU))


def _hit_against_full(runner: ModelRunner, ids: list[int], layout: str, storage: torch.dtype, block: int = 16):
    """(logits of a full prefill, logits of a prefill after a prefix cache hit, tokens reused)."""
    identity = KVIdentity("tiny", "float32", "cpu", layout, str(storage), block)
    blocks = BlockPool(64 << 20, CPU)
    pool = PrefixCache(blocks)
    options = dict(layout=layout, storage_dtype=storage, block_size=block, pool=blocks)
    full = runner.new_cache(len(ids) + 1, owner="full", **options)
    expected = runner.forward(torch.tensor(ids), 0, full)
    assert pool.store(pool.fresh_blocks(full, ids, identity), room=1 << 30) == len(ids) // block
    full.release()
    hit = pool.lookup(ids, identity, holder="hit")
    cache = runner.new_cache(len(ids) + 1, owner="cache", **options)
    cache.attach_prefix(list(hit.block_ids))  # shared, not copied
    hit.release()
    got = runner.forward(torch.tensor(ids[hit.tokens :]), hit.tokens, cache)
    assert cache.usage().tokens == len(ids)
    cache.release()
    pool.clear()
    assert blocks.held_bytes == 0  # every block back in the pool
    return expected, got, hit.tokens


@pytest.mark.parametrize("name", [spec.name for spec in SPECS])
def test_prefill_after_a_hit_equals_a_full_prefill_in_every_family(tiny_models, name):
    folder, _ = tiny_models[name]
    runner = _runner(folder)
    ids = torch.randint(3, runner.model.cfg.vocab_size, (53,), generator=torch.Generator().manual_seed(2)).tolist()
    for layout in ("gqa", "mha"):
        expected, got, reused = _hit_against_full(runner, ids, layout, torch.float32)
        assert reused == 48  # three blocks of 16; the last prompt tokens are always computed
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (layout, (got - expected).abs().max())


def test_a_prompt_of_whole_blocks_still_computes_its_last_token(tiny_models):
    runner = _runner(tiny_models["llama-gqa"][0])
    ids = list(range(3, 3 + 48))  # exactly three blocks: the third cannot be reused whole
    expected, got, reused = _hit_against_full(runner, ids, "gqa", torch.float32)
    assert reused == 32
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


def test_fp8_and_bfloat16_storage_reuse_their_bytes_exactly(tiny_models):
    # Kept blocks are the cache's own bytes (FP8 with its scales), so the reused prefix is what
    # a full prefill stored; only the recomputed tail can differ, by rounding (measured: not at
    # all, on the tiny models here).
    runner = _runner(tiny_models["qwen2"][0])
    ids = torch.randint(3, 96, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    for storage in (torch.float8_e4m3fn, torch.bfloat16):
        expected, got, reused = _hit_against_full(runner, ids, "gqa", storage)
        assert reused == 32 and int(got.argmax()) == int(expected.argmax())
        assert torch.allclose(got, expected, atol=2e-2, rtol=0), (storage, (got - expected).abs().max())


@pytest.mark.parametrize(("layout", "kv_dtype"), [("gqa", "auto"), ("mha", "auto"), ("gqa", "fp8"), ("mha", "fp8")])
def test_greedy_tokens_with_a_hit_equal_those_without(engine, reference, layout, kv_dtype):
    req = request(kv_layout=layout, kv_dtype=kv_dtype, max_tokens=12)
    _, expected = run(reference, req)
    first_events, first = run(engine, req)
    second_events, second = run(engine, req)
    assert prefix_event(first_events).blocks_hit == 0
    hit = prefix_event(second_events)
    assert hit.enabled and hit.blocks_hit == hit.blocks_looked_up > 0
    assert tokens(first) == tokens(second) == tokens(expected)
    assert second.text == expected.text
    assert second.usage.cached_tokens == hit.reused_tokens == hit.blocks_hit * 16
    assert second.usage.prompt_tokens == expected.usage.prompt_tokens


def test_a_hit_decodes_in_the_static_arena_too(engine, reference):
    # The static decoder lends one arena to each request's cache; the hit is copied into it.
    engine.runner.use_static_decode(True, capture=False)
    req = request(max_tokens=10)
    _, expected = run(reference, req)
    run(engine, req)
    events, second = run(engine, req)
    assert prefix_event(events).blocks_hit > 0
    assert tokens(second) == tokens(expected)


def test_generated_blocks_are_kept_for_the_next_turn(engine):
    # Full blocks of the answer are kept too (as vLLM keeps them): a prompt that continues the
    # first request's tokens reuses more than the first prompt's blocks.
    events, first = run(engine, request(max_tokens=40))
    prompt = next(e for e in events if isinstance(e, PromptEvent))
    fed = [p.token_id for p in prompt.pieces] + list(first.token_ids)
    hit = engine.prefix_cache.lookup(fed, engine.kv_identity("gqa", torch.float32, 16))
    assert hit.tokens > first.usage.prompt_tokens // 16 * 16


# -- the stage and its event --------------------------------------------------------------------


def test_the_prefix_cache_stage_and_its_event(engine):
    req = request()
    run(engine, req)
    events, result = run(engine, req)
    names = [e.name for e in events if isinstance(e, StageEvent)]
    assert names.index("admit") + 1 == names.index("prefix_cache") == names.index("prefill") - 1
    hit = prefix_event(events)
    prefill = next(e for e in events if isinstance(e, PrefillEvent))
    stage = next(e for e in events if isinstance(e, StageEvent) and e.name == "prefix_cache")
    assert hit.blocks_looked_up == (hit.prompt_tokens - 1) // 16
    assert hit.computed_tokens == hit.prompt_tokens - hit.reused_tokens >= 1
    assert prefill.reused_tokens == hit.reused_tokens and prefill.prompt_tokens == hit.prompt_tokens
    assert hit.duration_ms == pytest.approx(stage.duration_ms) and hit.copy_ms <= hit.duration_ms
    assert hit.kept_blocks > 0 and hit.kept_bytes > 0
    assert f"{hit.blocks_hit} of {hit.blocks_looked_up} blocks hit" in stage.detail
    assert result.prefix_cache == hit
    assert dict((e.name, e.detail) for e in result.timeline)["prefill_start"].endswith(
        f"after {hit.reused_tokens} reused"
    )


def test_no_prefix_cache_looks_nothing_up(reference):
    req = request()
    run(reference, req)
    events, result = run(reference, req)
    off = prefix_event(events)
    assert not off.enabled and off.blocks_hit == off.blocks_looked_up == 0
    assert "--no-enable-prefix-caching" in worded(off.note)
    assert result.usage.cached_tokens == 0
    assert any(isinstance(e, StageEvent) and e.name == "prefix_cache" and e.detail == "off" for e in events)


def test_turning_the_cache_off_drops_its_blocks(engine):
    run(engine, request())
    pool = engine.prefix_cache
    assert pool.kept_blocks > 0
    engine.use_prefix_cache(False)
    assert pool.kept_blocks == 0 and pool.kept_bytes == 0 and engine.prefix_cache is None
    engine.use_prefix_cache(True)
    events, _ = run(engine, request())
    assert prefix_event(events).blocks_hit == 0


# -- identity: never a block made under other settings ----------------------------------------


def test_blocks_of_another_layout_dtype_or_block_size_are_never_used(engine):
    run(engine, request())
    for other in (dict(kv_layout="mha"), dict(kv_dtype="bfloat16"), dict(kv_dtype="fp8"), dict(block_size=8)):
        events, _ = run(engine, request(**other))
        assert prefix_event(events).blocks_hit == 0, other
        events, _ = run(engine, request(**other))  # its own blocks, from the run just before
        assert prefix_event(events).blocks_hit > 0, other


def test_a_span_that_does_not_fit_the_cache_is_refused(tiny_models):
    cfg = ModelConfig.from_file(tiny_models["llama-gqa"][0])
    gqa = KVCache(cfg, 32, device=CPU, compute_dtype=torch.float32)
    mha = KVCache(cfg, 32, device=CPU, compute_dtype=torch.float32, layout="mha")
    span = KVSpan(torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, 16, 16))
    gqa.write_prefix(span)
    with pytest.raises(ValueError, match="does not fit this cache"):
        mha.write_prefix(span)
    fp8 = KVCache(cfg, 32, device=CPU, compute_dtype=torch.float32, storage_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not fit this cache"):
        fp8.write_prefix(span)
    with pytest.raises(ValueError, match="empty cache only"):
        gqa.write_prefix(span)


# -- memory: within the KV budget, least recently used first ----------------------------------


KIB_BLOCK = BlockFormat(layers=1, heads=1, head_dim=8, block_size=16, dtype=torch.float32)  # 1 KiB a block


def _prefix_cache() -> PrefixCache:
    return PrefixCache(BlockPool(1 << 20, CPU))


def _fresh(pool: PrefixCache, ids: list[int]) -> FreshBlocks:
    """Full blocks for `ids`, 1 KiB each, as a request-owned cache hands them over: already
    copied into pool blocks the prefix cache holds (those `store` does not keep go back)."""
    chain = block_hashes(ids, IDENTITY, len(ids) // 16)
    blocks = pool.pool.allocate(KIB_BLOCK, PREFIX, len(chain))
    return FreshBlocks(tuple(chain), KIB_BLOCK, tuple(zip(chain, blocks, strict=True)), held=True)


def test_eviction_is_least_recently_used_and_a_chain_loses_its_tail_first():
    pool = _prefix_cache()
    a, b = list(range(48)), list(range(1000, 1048))
    assert pool.store(_fresh(pool, a), room=6 * 1024) == 3
    assert pool.store(_fresh(pool, b), room=6 * 1024) == 3
    assert pool.lookup(a + [1], IDENTITY).blocks == 3  # a is now the most recently used
    assert pool.evict(1024) == 1024  # b's last block goes first
    assert pool.lookup(b + [1], IDENTITY).blocks == 2
    assert pool.lookup(a + [1], IDENTITY).blocks == 3
    assert pool.evict(2048) == 2048  # then the rest of b, tail first, still before a
    assert pool.lookup(b + [1], IDENTITY).blocks == 0 and pool.lookup(a + [1], IDENTITY).blocks == 3
    assert pool.kept_bytes == 3 * 1024 and pool.evicted_blocks == 3
    assert pool.pool.held_bytes == pool.kept_bytes  # the evicted blocks are back in the block pool


def test_store_keeps_a_chain_from_its_first_block_within_the_room():
    pool = _prefix_cache()
    assert pool.store(_fresh(pool, list(range(64))), room=2 * 1024 + 100) == 2
    assert pool.lookup(list(range(64)) + [0], IDENTITY).blocks == 2 and pool.kept_bytes == 2048
    # A new chain evicts older blocks to fit, never its own parents.
    assert pool.store(_fresh(pool, list(range(500, 548))), room=2 * 1024) == 2
    assert pool.lookup(list(range(500, 548)) + [0], IDENTITY).blocks == 2
    assert pool.lookup(list(range(64)) + [0], IDENTITY).blocks == 0


def test_admission_evicts_kept_blocks_and_never_waits_for_them():
    pool = _prefix_cache()
    pool.store(_fresh(pool, list(range(160))), room=1 << 20)  # ten blocks, 10 KiB
    scheduler = Scheduler(kv_budget_bytes=16 * 1024)
    admission = scheduler.admit("r", prompt_tokens=1, max_tokens=1, context_limit=10, kv_bytes=12 * 1024, kept=pool)
    assert scheduler.held_bytes + pool.kept_bytes <= scheduler.kv_budget_bytes
    assert pool.kept_bytes == 4 * 1024  # six evicted, least recently used (the chain's tail) first
    assert pool.lookup(list(range(160)), IDENTITY).blocks == 4
    # A request that cannot fit beside the running one waits, and the kept blocks stay meanwhile.
    with pytest.raises(AdmissionError, match="waited"):
        scheduler.admit("s", prompt_tokens=1, max_tokens=1, context_limit=10, kv_bytes=8 * 1024,
                        timeout_s=0.1, kept=pool)  # fmt: skip
    assert pool.kept_bytes == 4 * 1024
    room = scheduler.within_budget(lambda room: room, releasing=admission)
    assert room == 16 * 1024
    scheduler.release(admission)


def test_kept_blocks_stay_within_the_budget_across_requests(chatty_tiny_dir):
    # A budget of about two requests' worth: every new prompt's blocks push older ones out.
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=1 << 30)
    needed = next(e for e in engine.start(request()) if isinstance(e, AdmitEvent)).kv_needed_bytes
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=needed * 2)
    pool = engine.prefix_cache
    for i in range(5):
        events, _ = run(engine, request(system=f"Prompt number {i}. " + SYSTEM))
        assert pool.kept_bytes <= engine.scheduler.kv_budget_bytes
        assert engine.scheduler.held_bytes == 0
    assert pool.evicted_blocks > 0
    # The most recent prompt is still there; the first was evicted.
    events, _ = run(engine, request(system="Prompt number 4. " + SYSTEM))
    assert prefix_event(events).blocks_hit == prefix_event(events).blocks_looked_up
    events, _ = run(engine, request(system="Prompt number 0. " + SYSTEM))
    assert prefix_event(events).blocks_hit < prefix_event(events).blocks_looked_up


def test_a_budget_of_exactly_one_request_still_runs_requests_one_after_another(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=1 << 30)
    probe = request(system="Prompt number 1. " + SYSTEM)
    needed = next(e for e in engine.start(probe) if isinstance(e, AdmitEvent)).kv_needed_bytes
    engine.scheduler.kv_budget_bytes = needed
    for system in ("Prompt number 2. ", "Prompt number 3. ", "Prompt number 3. "):
        events, result = run(engine, request(system=system + SYSTEM))
        assert engine.prefix_cache.kept_bytes <= needed
    assert prefix_event(events).blocks_hit > 0  # the same prompt again: kept within the one request's room


# -- the real default model ---------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_hit_equals_full_prefill_and_greedy_tokens(default_engine):
    runner = default_engine.runner
    ids = default_engine.tokenizer.encode(SYSTEM + " Which hotels in Kyoto have roll-in showers?")
    expected, got, reused = _hit_against_full(runner, ids, "gqa", torch.float32)
    assert reused >= 32
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    # Through sessions: greedy tokens after a hit are those of the run that computed everything.
    req = request("What is the step-free route from Kyoto Station to Gion?", system="Prefix cache test. " + SYSTEM,
                  max_tokens=24)  # fmt: skip
    first_events, first = run(default_engine, req)
    second_events, second = run(default_engine, req)
    assert prefix_event(second_events).reused_tokens >= 128 > prefix_event(first_events).reused_tokens
    assert tokens(second) == tokens(first) and second.text == first.text



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_hit_on_cuda_decodes_through_the_captured_graphs(chatty_tiny_dir, kv_dtype):
    # On CUDA the static decoder's arena (captured in CUDA graphs) is the cache; the hit is copied
    # into the arena in place, at the addresses the graphs were captured with.
    engine = Engine(chatty_tiny_dir, device="cuda", dtype="bfloat16", kv_budget_bytes=256 << 20)
    plain = Engine(chatty_tiny_dir, device="cuda", dtype="bfloat16", kv_budget_bytes=256 << 20, prefix_cache=False)
    req = request(kv_dtype=kv_dtype, max_tokens=16)
    _, expected = run(plain, req)
    run(engine, req)
    events, second = run(engine, req)
    assert prefix_event(events).blocks_hit > 0
    assert tokens(second) == tokens(expected)
