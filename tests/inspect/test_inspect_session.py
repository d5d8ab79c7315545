"""Inspection as a request sees it: asked for or not, on its tokens, held steps on demand, kept in traces.

On the chatty tiny model (the default model's tokenizer and template, random weights), CPU float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minengine.engine.events import PromptEvent, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.inspect.ask import NOTHING, InspectAsk
from minengine.inspect.positions import OUTPUT, PROMPT, TEMPLATE_KIND, position_origin
from minengine.inspect.records import STRIP_MAX
from minengine.inspect.summary import _strips
from minengine.record.trace_io import event_from_record, event_record, read_trace, write_trace
from minengine.sampling.params import SamplingParams
from reqscope.cli import main

OLD_TRACE = Path(__file__).parent.parent / "data" / "explorer-trace.jsonl"
ASK = InspectAsk(attention_top=3, lens="candidates", lens_candidates=8)


def _request(max_tokens=5, prompt="Name three colours.", **kw) -> GenerationRequest:
    return GenerationRequest.from_prompt(prompt, sampling=SamplingParams(temperature=0), max_tokens=max_tokens, **kw)


def _tokens(events) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent)]


def test_nothing_asked_runs_the_lean_step_and_records_nothing(chatty_engine, monkeypatch):
    runner = chatty_engine.runner
    calls = {"lean": 0}

    def counted(lean):
        def counted_lean(*a, **k):
            calls["lean"] += 1
            return lean(*a, **k)

        return counted_lean

    for name in ("step_stack", "step_blocks"):  # the lean step through the C stack or the Python blocks
        monkeypatch.setattr(runner.eager_decoder, name, counted(getattr(runner.eager_decoder, name)))
    tokens = _tokens(chatty_engine.start(_request()))
    assert calls["lean"] == len(tokens) - 1  # every decode step; the first token is prefill's
    assert all(t.inspection is None for t in tokens)
    session = chatty_engine.start(_request())
    session.inspect(ASK)
    calls["lean"] = 0
    inspected = _tokens(session)
    assert calls["lean"] == 0  # an inspected step takes the general path, whose attention shows its operands
    assert [t.token_id for t in inspected] == [t.token_id for t in tokens]  # capture changes no token


def test_asked_steps_carry_attention_lens_and_cost_and_stop_when_told(chatty_engine):
    cfg = chatty_engine.cfg
    session = chatty_engine.start(_request(max_tokens=6))
    prompt_tokens, seen = 0, []
    for event in session:
        if isinstance(event, PromptEvent):
            prompt_tokens = len(event.pieces)
            session.inspect(ASK)
        if isinstance(event, TokenEvent):
            seen.append(event)
            if event.index == 2:
                session.inspect(NOTHING)
    assert [t.inspection is not None for t in seen] == [True, True, True, False, False, False]
    for t in seen[:3]:
        a, lens = t.inspection.attention, t.inspection.lens
        assert a.query_position == prompt_tokens - 1 + t.index and a.context == a.query_position + 1
        assert len(a.layers) == cfg.num_hidden_layers and len(a.layers[0].heads) == cfg.num_attention_heads
        assert all(len(h.top) == 3 for layer in a.layers for h in layer.heads)
        assert all(sum(x.weight for x in h.top) <= 1 + 1e-5 for layer in a.layers for h in layer.heads)
        assert lens.chosen == t.token_id and lens.basis == "candidates" and lens.candidates == 8
        assert lens.layers[-1].chosen_rank == 1  # greedy
        assert t.inspection.cost.work_ms > 0 and t.inspection.cost.cost_ms >= 0


def test_a_held_step_on_demand_matches_the_step_captured_as_it_ran(chatty_engine):
    session = chatty_engine.start(_request(max_tokens=4))
    session.inspect(ASK)
    on_demand = None
    for event in session:
        if isinstance(event, StepReady) and event.index == 2:
            before = session.pending_logits.clone()
            on_demand = session.inspect_step()
            assert torch.equal(session.pending_logits, before)
        if isinstance(event, TokenEvent) and event.index == 2:
            captured = event.inspection
    assert on_demand.on_demand and on_demand.lens.basis == "vocab" and on_demand.lens.chosen == captured.lens.chosen
    for ours, live in zip(on_demand.attention.layers, captured.attention.layers, strict=True):
        assert sum(ours.strip.weights) == pytest.approx(1.0, abs=1e-5)
        for a, b in zip(ours.heads, live.heads, strict=True):
            assert a.top[0].position == b.top[0].position
            assert a.entropy == pytest.approx(b.entropy, abs=1e-4)
    assert session.inspect_step() is None  # nothing is held after the run


def test_an_uninspected_run_inspected_on_demand_gives_the_same_tokens(chatty_engine):
    plain = [t.token_id for t in _tokens(chatty_engine.start(_request(max_tokens=6)))]
    session = chatty_engine.start(_request(max_tokens=6))
    ids = []
    for event in session:
        if isinstance(event, StepReady):
            assert session.inspect_step(InspectAsk(attention_top=2, lens="vocab")) is not None
        if isinstance(event, TokenEvent):
            ids.append(event.token_id)
    assert ids == plain  # the recompute wrote nothing the later steps read


def test_a_batch_row_has_its_own_views(chatty_engine):
    from concurrent_runs import run_all

    requests = [_request(max_tokens=5), _request(max_tokens=5, prompt="Count to five.")]
    alone = _tokens(_inspected(chatty_engine, requests[0]))
    together = run_all(chatty_engine, requests, prepare=lambda s: s.inspect(ASK))
    mine = _tokens(together[0])
    shared = [t for t in mine if t.batch is not None and t.batch.sequences > 1]
    assert shared, "the two requests never shared a step"
    for t in shared:
        solo = alone[t.index].inspection.attention
        for a, b in zip(t.inspection.attention.layers, solo.layers, strict=True):
            assert [h.top[0].position for h in a.heads] == [h.top[0].position for h in b.heads]


def _inspected(engine, request):
    session = engine.start(request)
    session.inspect(ASK)
    return list(session)


def test_positions_are_told_apart_and_reused_ones_marked(chatty_engine):
    long = "Tell me about the history of the city of Kyoto and its temples, gardens and old streets. " * 2
    first = _inspected(chatty_engine, _request(max_tokens=2, prompt=long))
    events = _inspected(chatty_engine, _request(max_tokens=2, prompt=long))
    prompt = next(e for e in events if isinstance(e, PromptEvent))
    reused = next(e for e in events if type(e).__name__ == "PrefixCacheEvent").reused_tokens
    assert reused > 0 and len(prompt.token_parts) == len(prompt.pieces) and first
    kinds = [position_origin(p, prompt.token_parts, reused) for p in range(len(prompt.pieces) + 1)]
    assert kinds[0].kind == TEMPLATE_KIND and kinds[0].reused  # <|im_start|>, from the cache
    assert {k.kind for k in kinds[:-1]} == {PROMPT, TEMPLATE_KIND}
    assert kinds[-1] == position_origin(len(prompt.pieces), prompt.token_parts, reused)
    assert kinds[-1].kind == OUTPUT and not kinds[-1].reused
    assert not kinds[len(prompt.pieces) - 1].reused  # the last prompt token is always computed
    assert sum(p.tokens for p in prompt.parts) == len(prompt.token_parts)


def test_a_long_context_strip_is_bucketed_and_sums_to_one():
    context = 5 * STRIP_MAX + 3
    mean = torch.softmax(torch.randn(2, context), -1)
    strips = _strips(mean)
    assert strips[0].bucket == 6 and len(strips[0].weights) <= STRIP_MAX
    assert sum(strips[0].weights) == pytest.approx(1.0, abs=1e-4)
    assert strips[1].weights[0] == pytest.approx(float(mean[1, :6].sum()), abs=1e-6)


def test_inspections_round_trip_through_a_trace(chatty_engine, tmp_path):
    from minengine.record.trace_io import trace_header

    events = _inspected(chatty_engine, _request(max_tokens=3))
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace_header(chatty_engine), events)
    _, back = read_trace(path)
    assert _tokens(back) == _tokens(events)
    assert next(e for e in back if isinstance(e, PromptEvent)).token_parts


def test_older_traces_load_without_inspection_and_newer_keys_are_skipped():
    _, events = read_trace(OLD_TRACE)
    assert _tokens(events) and all(t.inspection is None for t in _tokens(events))
    assert all(e.token_parts == () for e in events if isinstance(e, PromptEvent))
    record = event_record(_tokens(events)[0]) | {"a_later_field": {"x": 1}}  # a reader meets keys it predates
    assert event_from_record(record) == _tokens(events)[0]


def test_json_records_carry_the_views_only_when_asked(chatty_tiny_dir, capsys, tmp_path):
    base = ["--json", "--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "3", "hi"]
    assert main(base) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert not any("attention" in r or "lens" in r for r in plain)
    export = tmp_path / "run"
    assert main(base[:-1] + ["--attention", "4", "--lens-vocab", "--export", str(export), "hi"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens = [r for r in records if r["event"] == "token"]
    for t in tokens:
        heads = t["attention"]["layers"][0]["heads"]
        assert heads[0]["kv_head"] == 0 and len(heads[0]["top"]) == 4 and len(heads[0]["top"][0]) == 2
        assert t["lens"]["basis"] == "vocab" and t["lens"]["chosen"] == t["token_id"]
        assert t["inspect_cost"]["cost_ms"] >= 0
    _, events = read_trace(export / "request-trace.jsonl")
    kept = _tokens(events)
    assert [k.inspection.lens.chosen for k in kept] == [t["token_id"] for t in tokens]


def test_a_negative_attention_count_is_one_line(chatty_tiny_dir, capsys):
    code = main(["--json", "--model", str(chatty_tiny_dir), "--attention", "-2", "hi"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "reqscope: error: --attention -2: give the top positions to keep, 1 or more (0 records none)"
    ]
