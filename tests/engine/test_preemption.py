"""Preemption by recompute: when the block pool runs out mid-decode, the newest request gives its
blocks back, says so in its stream, and recomputes; every request still gets its own tokens, and
every block is back in the pool afterwards."""

from __future__ import annotations

import pytest
from concurrent_runs import run_all

from minengine.engine.batch_facts import PreemptEvent
from minengine.engine.engine import Engine
from minengine.engine.events import AdmitEvent, DoneEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ("Tell me about Kyoto", "What is a KV cache?", "Hi there", "Name three hotels in Osaka")


def _request(prompt: str) -> GenerationRequest:
    return GenerationRequest.from_prompt(prompt, sampling=GREEDY, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("room", [2.0, 1.5])  # a tighter pool preempts more, mid-prefill and between steps
def test_a_full_pool_preempts_the_newest_request_which_recomputes_its_tokens(chatty_tiny_dir, room):
    probe = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    alone = [next(e for e in probe.start(_request(p)) if isinstance(e, DoneEvent)).result for p in PROMPTS]
    worst = max(next(e for e in probe.start(_request(p)) if isinstance(e, AdmitEvent)).kv_needed_bytes for p in PROMPTS)
    # Room for every prompt at once, not for every answer: decode runs the pool dry.
    budget = int(worst * room)
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=budget, prefix_cache=False)
    together = run_all(engine, [_request(p) for p in PROMPTS])
    results = [evs[-1].result for evs in together]
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]  # recompute loses and repeats nothing
    preempts = [[e for e in evs if isinstance(e, PreemptEvent)] for evs in together]
    assert sum(map(len, preempts)) == engine.steps.preemptions > 0
    for evs, events, result in zip(together, preempts, results, strict=True):
        assert result.batch.preemptions == len(events)
        for event in events:
            assert event.blocks_freed > 0 and event.bytes_freed % event.blocks_freed == 0
            assert "no free block" in event.reason and event.tokens_to_recompute > 0
            tokens_before = sum(1 for e in evs if isinstance(e, TokenEvent) and e.t_ms <= event.t_ms)
            assert event.tokens_to_recompute >= tokens_before  # the prompt and every token fed so far
        steps = [e.batch for e in evs if isinstance(e, TokenEvent) and e.batch is not None]
        assert all(s.pool.own + s.pool.others + s.pool.prefix + s.pool.free == s.pool.budget for s in steps)
        assert all(s.pool.own > 0 for s in steps)  # its blocks, as the pool counts them
    assert engine.pool.held_bytes == 0 and engine.pool.holders() == {}  # every block is back
    assert engine.scheduler.running == 0 and engine.scheduler.held_bytes == 0 and engine.steps.running == 0
