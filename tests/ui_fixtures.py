"""Helpers for the explorer's tests: the recorded trace, app builders, and waiting on the app."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, StageEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.roofline import ReadCeiling, step_bytes
from minengine.record.trace_io import read_trace
from minengine.sampling.params import SamplingParams
from reqscope.run_options import DEFAULT_PROMPT
from reqscope.ui.run.app import RunExplorer
from reqscope.ui.run.live_app import LiveExplorer
from reqscope.ui.run.replay_app import ReplayExplorer

# A real run of the default model, recorded with:
#   reqscope --plain --export DIR --max-tokens 12 "Show me wheelchair-accessible hotels in Kyoto"
# (temperature 0.7, top-k 50, top-p 0.9, seed 0), DIR/request-trace.jsonl copied here.
TRACE = Path(__file__).parent / "data" / "explorer-trace.jsonl"
TRACE_NAME = "explorer-trace.jsonl"


def replay_app(**options) -> ReplayExplorer:
    """The explorer replaying the recorded trace."""
    header, events = read_trace(TRACE)
    return ReplayExplorer(header, events, source_name=TRACE_NAME, **options)


def held_replay_app(at: int = 5, held_ms: float = 2500.0, **options) -> ReplayExplorer:
    """The recorded trace as if the run had been held `held_ms` at step `at` (paused, then stepped).

    Tokens from `at` on come `held_ms` later and token `at` carries the held time, as the engine
    records them. The trace ends before decode closes (its stages and result are left out), so
    replay it mid-run.
    """
    header, events = read_trace(TRACE)
    held = []
    for event in events:
        if isinstance(event, DoneEvent) or (isinstance(event, StageEvent) and event.name in ("decode", "complete")):
            continue
        if isinstance(event, TokenEvent) and event.index >= at:
            first = event.index == at
            event = replace(event, t_ms=event.t_ms + held_ms, held_ms=held_ms if first else 0.0,
                            itl_ms=event.itl_ms + held_ms if first and event.itl_ms is not None else event.itl_ms)
        held.append(event)
    return ReplayExplorer(header, held, source_name=TRACE_NAME, **options)


# What the recorded run's decode steps read: SmolLM2-135M's float32 weights (134,515,008
# parameters, the head tied to the embedding table) and the K/V its cache held; and a ceiling
# measured on the machine it ran on.
RECORDED_WEIGHT_BYTES = 134_515_008 * 4
RECORDED_CEILING = ReadCeiling(16.1e9, "sum over 512 MiB, fastest of 15 passes; matvec 13.9 GB/s",
                               "cpu AMD EPYC, 2 threads", "2026-12-01 09:55 UTC", "reqscope calibrate")  # fmt: skip


def roofline_replay_app(ceiling: ReadCeiling | None = RECORDED_CEILING, **options) -> ReplayExplorer:
    """The recorded trace as a run that kept the roofline records it: each decode step's bytes on its
    token event, and the machine's read ceiling (or none) in the header."""
    header, events = read_trace(TRACE)
    events = [replace(e, bytes_read=step_bytes(RECORDED_WEIGHT_BYTES, e.kv)) if isinstance(e, TokenEvent) and e.index
              else e for e in events]  # fmt: skip
    return ReplayExplorer(replace(header, read_ceiling=ceiling), events, source_name=TRACE_NAME, **options)


def kyoto_request(**changes) -> GenerationRequest:
    """The default prompt with the CLI's default sampling (seeded)."""
    defaults = {"sampling": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=0), "max_tokens": 8}
    return GenerationRequest.from_prompt(DEFAULT_PROMPT, **(defaults | changes))


def live_app(engine: Engine, request: GenerationRequest, **options) -> LiveExplorer:
    """The explorer over an already loaded engine."""
    return LiveExplorer(lambda progress: engine, request, **options)


async def wait_for(pilot, condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Let the app run until `condition()` holds (fails the test after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for the app")
        await pilot.pause(0.02)
    await pilot.pause()  # one more turn so the screen reflects the state


async def held_at(pilot, app: LiveExplorer, index: int) -> None:
    """Wait until the live run holds at step `index` (0-based) and the screen shows it."""
    await wait_for(pilot, lambda: app.held_step == index)
    await wait_for(pilot, lambda: app.repaints > 0 and not app.needs_repaint)


async def finished(pilot, app: RunExplorer, timeout: float = 120.0) -> None:
    """Wait until the request on screen has finished and is drawn."""
    await wait_for(pilot, lambda: app.view.result is not None, timeout)
    await wait_for(pilot, lambda: not app.needs_repaint)
