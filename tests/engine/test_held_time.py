"""Engine time against held time: a step the consumer holds is not the engine's inter-token latency."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from minengine.engine.events import DoneEvent, StepReady, TokenEvent
from minengine.engine.metrics import MetricsInputError, request_metrics, without_held
from minengine.engine.request import GenerationRequest
from minengine.record.export import METRICS_JSON, TELEMETRY_JSON, TRACE_JSONL, export_run
from minengine.record.trace_io import read_trace
from minengine.sampling.params import SamplingParams
from reqscope.console.jsonl import done_record

GREEDY = SamplingParams(temperature=0.0)
HOLD_S = 0.5
TRACE = Path(__file__).parent.parent / "data" / "explorer-trace.jsonl"


def _session(engine, max_tokens: int = 6):
    return engine.start(GenerationRequest.from_prompt("Tell me about Kyoto", sampling=GREEDY, max_tokens=max_tokens))


def _drive(session, hold_at: dict[int, float] | None = None, sleep_without_hold: dict[int, float] | None = None):
    """Pull every event; at StepReady i, hold for hold_at[i] seconds (telling the session), or just sleep."""
    events = []
    for event in session:
        events.append(event)
        if isinstance(event, StepReady):
            if hold_at and event.index in hold_at:
                session.hold()
                time.sleep(hold_at[event.index])
            if sleep_without_hold and event.index in sleep_without_hold:
                time.sleep(sleep_without_hold[event.index])
    return events, events[-1].result


def _tokens(events):
    return [e for e in events if isinstance(e, TokenEvent)]


def test_a_held_step_is_held_time_not_engine_itl(chatty_engine):
    events, result = _drive(_session(chatty_engine), hold_at={3: HOLD_S})
    tokens = _tokens(events)
    held = tokens[3]
    assert HOLD_S * 1000 <= held.held_ms < HOLD_S * 1000 + 250
    assert all(t.held_ms == 0.0 for t in tokens if t is not held)
    engine_itl = held.itl_ms - held.held_ms
    assert held.itl_ms >= HOLD_S * 1000  # the wall clock saw the whole pause
    assert held.itl_ms - engine_itl >= HOLD_S * 1000  # the engine's own gap is one model step, far below it
    assert engine_itl < HOLD_S * 1000
    assert result.held_ms == pytest.approx(held.held_ms)
    wall, engine = result.metrics, result.engine_metrics
    assert wall.itl.max >= HOLD_S * 1000 > engine.itl.max
    assert wall.ttft_ms == engine.ttft_ms  # held after the first token: TTFT is untouched
    assert wall.e2e_ms - engine.e2e_ms == pytest.approx(held.held_ms)


def test_engine_metrics_are_the_seed_formulas_over_the_times_without_held(chatty_engine):
    events, result = _drive(_session(chatty_engine, max_tokens=8), hold_at={0: 0.2, 4: 0.3})
    tokens = _tokens(events)
    held_before, total = [], 0.0
    for t in tokens:
        total += t.held_ms
        held_before.append(total)
    visible = [(t.t_ms - h) for t, h in zip(tokens, held_before, strict=True) if t.text]
    s = next(ev.t_ms for ev in result.timeline if ev.name == "client_send")
    f, e, o = visible[0], visible[-1], len(visible)
    engine = result.engine_metrics
    assert engine.output_tokens == o
    assert engine.ttft_ms == pytest.approx(f - s)
    assert engine.e2e_ms == pytest.approx(e - s)
    assert engine.tpot_ms == pytest.approx((e - f) / (o - 1))
    assert engine.decode_output_tokens_per_second == pytest.approx((o - 1) / ((e - f) / 1000))
    assert engine.whole_request_output_tokens_per_second == pytest.approx(o / ((e - s) / 1000))
    gaps = [b - a for a, b in zip(visible, visible[1:], strict=False)]
    assert engine.itl.max == pytest.approx(max(gaps)) and engine.itl.mean == pytest.approx(engine.tpot_ms)
    # A hold before the first token is in the wall clock's TTFT, not the engine's.
    assert result.metrics.ttft_ms - engine.ttft_ms == pytest.approx(tokens[0].held_ms)
    assert tokens[0].held_ms >= 200 and result.held_ms == pytest.approx(total)


def test_a_headless_run_has_engine_equal_to_wall(chatty_engine):
    events, result = _drive(_session(chatty_engine))
    assert all(t.held_ms == 0.0 for t in _tokens(events))
    assert result.held_ms == 0.0
    assert result.engine_metrics == result.metrics


def test_only_a_declared_hold_counts(chatty_engine):
    """A consumer that is slow without saying it holds (a slow pipe, a busy server) is the client's view."""
    events, result = _drive(_session(chatty_engine), sleep_without_hold={2: 0.2})
    assert result.held_ms == 0.0 and result.engine_metrics == result.metrics
    assert _tokens(events)[2].itl_ms >= 200


def test_closing_the_session_early_still_releases_the_cache(chatty_engine):
    session = _session(chatty_engine)
    made = []
    new_cache = session._new_cache
    session._new_cache = lambda kv: made.append(new_cache(kv)) or made[-1]
    events = iter(session)
    for event in events:
        if isinstance(event, TokenEvent):
            break
    assert len(made) == 1 and made[0].capacity > 0  # the session holds its cache
    events.close()  # a consumer that stops mid-stream: the timing wrapper passes the close on
    assert made[0].capacity == 0 and chatty_engine.scheduler.running == 0  # released


def test_without_held_checks_its_input():
    assert without_held([10.0, 20.0, 530.0], [0.0, 0.0, 500.0]) == (10.0, 20.0, 30.0)
    with pytest.raises(MetricsInputError):
        without_held([1.0, 2.0], [0.0])
    with pytest.raises(MetricsInputError):
        without_held([1.0, 2.0], [5.0, 1.0])
    times = without_held([190.0, 215.0, 740.0], [0.0, 0.0, 500.0])
    assert request_metrics(0.0, times[0], times[-1], 3, times).tpot_ms == 25.0


def test_held_time_round_trips_through_the_trace_and_the_exports(chatty_engine, tmp_path):
    session = _session(chatty_engine)
    events, result = _drive(session, hold_at={2: 0.1})
    header_source = read_trace(TRACE)[0]
    export_run(result, tmp_path, events, header_source)
    _, loaded = read_trace(tmp_path / TRACE_JSONL)
    tokens = _tokens(loaded)
    assert [t.held_ms for t in tokens] == [t.held_ms for t in _tokens(events)]
    done = loaded[-1]
    assert isinstance(done, DoneEvent)
    assert done.result.engine_metrics == result.engine_metrics and done.result.held_ms == result.held_ms
    metrics = json.loads((tmp_path / METRICS_JSON).read_text())
    assert metrics["held_ms"] == pytest.approx(result.held_ms)
    assert metrics["ttft_ms"] == result.metrics.ttft_ms  # the seed's keys: wall clock
    assert metrics["engine_metrics"]["e2e_ms"] == pytest.approx(result.engine_metrics.e2e_ms)
    assert metrics["e2e_ms"] - metrics["engine_metrics"]["e2e_ms"] == pytest.approx(result.held_ms)
    assert list(metrics["engine_metrics"]["itl_ms"]) == list(metrics["itl_ms"])
    telemetry = json.loads((tmp_path / TELEMETRY_JSON).read_text())
    assert telemetry["held_ms"] == pytest.approx(result.held_ms, abs=1e-3)
    assert telemetry["engine_metrics"]["tpot_ms"] == pytest.approx(result.engine_metrics.tpot_ms)
    record = done_record(result)
    assert record["metrics"]["e2e_ms"] == result.metrics.e2e_ms
    assert record["engine_metrics"]["e2e_ms"] == result.engine_metrics.e2e_ms


def test_a_trace_recorded_before_held_time_still_loads():
    _, events = read_trace(TRACE)
    tokens = _tokens(events)
    assert tokens and all(t.held_ms == 0.0 for t in tokens)
    result = events[-1].result
    assert result.engine_metrics is None and result.held_ms == 0.0 and result.metrics is not None
