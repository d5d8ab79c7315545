"""Unsteered decode: the step loop samples a request's tokens in its steps and goes on without the
consumer (`minengine.engine.run_ahead`). Whatever the request asks, it ends with the tokens, text,
finish reason and per-token facts a steered run of it gives, alone or beside others, cancelled,
stopped by a string (the loop may have run one step too many), or preempted; and every block is
back in the pool afterwards."""

from __future__ import annotations

import threading

import pytest
from concurrent_runs import run_all

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, RequestResult, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.errors import RequestError
from minengine.inspect.ask import FULL_VIEW
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
PROMPTS = ("Tell me about Kyoto", "What is a KV cache?", "Hi there", "Name three hotels in Osaka")


def _request(prompt: str = PROMPTS[0], **kwargs) -> GenerationRequest:
    kwargs.setdefault("sampling", GREEDY)
    kwargs.setdefault("max_tokens", 24)
    return GenerationRequest.from_prompt(prompt, **kwargs)


def _run(engine: Engine, request: GenerationRequest, steered: bool) -> tuple[list, RequestResult]:
    events = list(engine.start(request, steered=steered))
    assert isinstance(events[-1], DoneEvent)
    return events, events[-1].result


def _same_outcome(a: RequestResult, b: RequestResult) -> None:
    assert (a.token_ids, a.text, a.finish_reason, a.usage) == (b.token_ids, b.text, b.finish_reason, b.usage)


def _pool_is_empty(engine: Engine) -> None:
    assert engine.pool.held_bytes == 0 and engine.pool.holders() == {}
    assert engine.scheduler.running == 0 and engine.steps.running == 0


@pytest.fixture
def engine(chatty_tiny_dir) -> Engine:
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)


@pytest.mark.parametrize(
    "extras",
    [
        {},
        {"sampling": SAMPLED},  # its own seeded generator, drawn on the model thread
        {"sampling": SAMPLED, "trace": True, "top_n": 5},  # the trace made in the step
        {"trace": True, "top_n": 5},
        {"max_tokens": 1},  # prefill's token is the last: nothing runs ahead
        {"max_tokens": 2},
    ],
)
def test_an_unsteered_request_gets_the_steered_tokens_text_and_events(engine, extras):
    req = _request(**extras)
    steered_events, steered = _run(engine, req, steered=True)
    events, result = _run(engine, req, steered=False)
    _same_outcome(result, steered)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    reference = [e for e in steered_events if isinstance(e, TokenEvent)]
    assert [e.text for e in tokens] == [e.text for e in reference]
    assert [e.kv.tokens for e in tokens] == [e.kv.tokens for e in reference]  # as of its own step
    assert [e.kv.physical_bytes for e in tokens] == [e.kv.physical_bytes for e in reference]
    assert [e.trace is None for e in tokens] == [not req.trace] * len(tokens)
    if req.trace:
        assert [e.trace.chosen_id for e in tokens] == [e.token_id for e in tokens]
        assert [e.trace.candidates for e in tokens] == [e.trace.candidates for e in reference]
    assert all((e.batch is None) == (e.index == 0) for e in tokens)  # prefill made the first token
    assert sum(isinstance(e, StepReady) for e in events) == len(tokens)
    assert result.batch.steps == steered.batch.steps  # no step ran beyond the last token
    _pool_is_empty(engine)


def test_stop_tokens_min_tokens_and_stop_strings_end_it_where_a_steered_run_ends(engine):
    probe = _run(engine, _request(max_tokens=16), steered=True)[1]
    stop_id, stop_text = probe.token_ids[5], probe.text[-6:]
    for extras in (
        {"stop_token_ids": (stop_id,)},
        {"stop_token_ids": (stop_id,), "min_tokens": 8},  # masked until then, as vLLM does
        {"stop": (stop_text,)},  # seen only by the consumer: the loop may have run a step more
        {"stop": (stop_text,), "min_tokens": 14},
    ):
        req = _request(max_tokens=16, **extras)
        _same_outcome(_run(engine, req, steered=False)[1], _run(engine, req, steered=True)[1])
        _pool_is_empty(engine)


def test_only_the_token_that_ends_a_request_says_it_is_the_last(engine):
    """`TokenEvent.last` (a server flushes that token's chunk before the request's end work)."""
    probe = _run(engine, _request(max_tokens=16), steered=True)[1]
    stop_id = probe.token_ids[5]
    for extras, ending in (({}, 16), ({"stop_token_ids": (stop_id,)}, probe.token_ids.index(stop_id) + 1)):
        for steered in (True, False):
            events, result = _run(engine, _request(max_tokens=16, **extras), steered=steered)
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            assert len(tokens) == len(result.token_ids) == ending
            assert [e.last for e in tokens] == [False] * (ending - 1) + [True]


def test_requests_unsteered_together_get_their_tokens_alone(engine):
    requests = [_request(p, sampling=GREEDY if i % 2 else SAMPLED, max_tokens=20) for i, p in enumerate(PROMPTS)]
    alone = [_run(engine, r, steered=True)[1] for r in requests]
    together = run_all(engine, requests, steered=False)
    for events, reference in zip(together, alone, strict=True):
        _same_outcome(events[-1].result, reference)
        assert max(e.batch.sequences for e in events if isinstance(e, TokenEvent) and e.batch) > 1
    _pool_is_empty(engine)


def test_a_cancelled_unsteered_request_stops_feeding_and_gives_its_blocks_back(engine):
    session = engine.start(_request(max_tokens=500, ignore_eos=True), steered=False)
    beside = []
    other = threading.Thread(target=lambda: beside.extend(engine.start(_request(PROMPTS[1], max_tokens=40))))
    other.start()
    tokens = 0
    for event in session:
        if isinstance(event, TokenEvent):
            tokens += 1
            if tokens == 5:
                threading.Thread(target=session.cancel).start()
        if isinstance(event, DoneEvent):
            result = event.result
    other.join(timeout=60)
    assert result.finish_reason == "cancelled" and 5 <= len(result.token_ids) < 500
    assert beside[-1].result.finish_reason == "length" and len(beside[-1].result.token_ids) == 40
    _pool_is_empty(engine)


def test_a_consumer_that_stops_reading_ends_it_and_the_loop_forgets_it(engine):
    session = engine.start(_request(max_tokens=200, ignore_eos=True), steered=False)
    events = iter(session)
    for event in events:
        if isinstance(event, TokenEvent) and event.index == 3:
            break
    events.close()  # the consumer walks away mid-run: what the loop still had for it is dropped
    assert session.result is None or session.result.finish_reason in ("cancelled", "length")
    _pool_is_empty(engine)
    _same_outcome(_run(engine, _request(max_tokens=6), steered=False)[1], _run(engine, _request(max_tokens=6), True)[1])


@pytest.mark.parametrize("room", [2.0, 1.5])
def test_preempted_unsteered_requests_recompute_and_keep_their_tokens(chatty_tiny_dir, room):
    reqs = [_request(p, max_tokens=48, ignore_eos=True) for p in PROMPTS]
    probe = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    alone = [_run(probe, r, steered=True)[1] for r in reqs]
    worst = max(r.kv_peak.physical_bytes for r in alone)
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=int(worst * room),
                    prefix_cache=False)  # fmt: skip
    together = run_all(engine, reqs, steered=False)
    for events, reference in zip(together, alone, strict=True):
        _same_outcome(events[-1].result, reference)
    assert engine.steps.preemptions > 0
    assert sum(events[-1].result.batch.preemptions for events in together) == engine.steps.preemptions
    _pool_is_empty(engine)


def test_an_unsteered_session_refuses_to_be_steered(engine):
    session = engine.start(_request(), steered=False)
    for call, what in (
        (lambda: session.force_next(5), "force a token"),
        (lambda: session.update_sampling(SAMPLED), "change its sampling parameters"),
        (lambda: session.inspect(FULL_VIEW), "be inspected"),
    ):
        with pytest.raises(RequestError, match=what):
            call()
    assert list(session)[-1].result.finish_reason == "length"
