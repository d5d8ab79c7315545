"""Helpers for the explorer's tests: the recorded trace, app builders, and waiting on the app."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from minengine.engine.batch_facts import BatchStep, BatchSummary, PreemptEvent, PrefillChunk
from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PrefillEvent, StageEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.roofline import ReadCeiling, step_bytes
from minengine.kv.usage import PoolUsage
from minengine.record.trace_io import TraceHeader, read_trace
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
# The same prompt recorded with the step's inside (issue 22: attention's top 5 positions per head,
# the logit lens over the step's 20 likeliest tokens), with:
#   reqscope --plain --export DIR --max-tokens 6 --attention 5 --lens \
#     "Show me wheelchair-accessible hotels in Kyoto"
INSPECT_TRACE = Path(__file__).parent / "data" / "explorer-inspect-trace.jsonl"


def replay_app(**options) -> ReplayExplorer:
    """The explorer replaying the recorded trace."""
    header, events = read_trace(TRACE)
    return ReplayExplorer(header, events, source_name=TRACE_NAME, **options)


def inspect_replay_app(**options) -> ReplayExplorer:
    """The explorer replaying the run recorded with its attention and logit lens (`INSPECT_TRACE`)."""
    header, events = read_trace(INSPECT_TRACE)
    return ReplayExplorer(header, events, source_name=INSPECT_TRACE.name, **options)


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


# A batched run, made from the recorded one: its prompt prefilled in two chunks beside other
# requests, each decode step shared with two or three other sequences (one with another
# request's prefill chunk in it), a queue behind it, and one preemption after token 8. The step
# times are the recorded ones; one sequence alone took SOLO_STEP_MS a step on the same engine.
SOLO_STEP_MS = 31.0
BATCH_BUDGET = 64 * 1024 * 1024
OTHERS_BYTES = 3_276_800  # the other sequences' blocks
PREFIX_BYTES = 2_211_840  # the prefix cache's


def batched_events() -> tuple[TraceHeader, list]:
    """The recorded trace with the batch facts a shared engine would have recorded."""
    header, events = read_trace(TRACE)
    out: list = []
    steps: list[BatchStep] = []
    for event in events:
        if isinstance(event, PrefillEvent):
            n, own, half_ms = event.prompt_tokens, event.kv.physical_bytes, event.duration_ms / 2
            first = n // 2
            chunks = (PrefillChunk(0, first, _shared_step(40, 3, 0, first, own // 2, half_ms)),
                      PrefillChunk(first, n - first, _shared_step(41, 4, 2, n - first, own, half_ms)))  # fmt: skip
            event = replace(event, chunks=chunks)
            steps += [c.step for c in chunks]
        elif isinstance(event, TokenEvent) and event.index:
            sequences = 3 if event.index < 3 else 4
            prefill = 96 if event.index == 5 else 0  # another request's prompt chunk shares this step
            step = _shared_step(41 + event.index, sequences, sequences - (prefill > 0), prefill,
                                event.kv.physical_bytes, event.step_ms - 1.5)  # fmt: skip
            event = replace(event, batch=step)
            steps.append(step)
        elif isinstance(event, DoneEvent):
            event = DoneEvent(replace(event.result, batch=BatchSummary.of(steps, prefill_chunks=2, preemptions=1)))
        out.append(event)
        if isinstance(event, TokenEvent) and event.index == 8:
            recompute = event.index + 1 + next(e.prompt_tokens for e in out if isinstance(e, PrefillEvent))
            out.append(PreemptEvent("no free block for the running requests' next tokens", 3, 3 * 16 * 23040,
                                    recompute, event.t_ms + 0.4))  # fmt: skip
    return header, out


def _shared_step(step: int, sequences: int, decode: int, prefill: int, own: int, step_ms: float) -> BatchStep:
    pool = PoolUsage(budget=BATCH_BUDGET, own=own, others=OTHERS_BYTES, prefix=PREFIX_BYTES)
    return BatchStep(step, sequences, decode, prefill, waiting=1 if step % 3 else 2, step_ms=step_ms,
                     solo_step_ms=SOLO_STEP_MS, pool=pool)


def batched_replay_app(**options) -> ReplayExplorer:
    """The explorer replaying the batched run (`batched_events`)."""
    header, events = batched_events()
    return ReplayExplorer(header, events, source_name=TRACE_NAME, **options)


def panel_text(app, selector: str) -> str:
    """What a panel (or any widget) of `app`'s screen draws, as plain text 300 columns wide."""
    import io

    from rich.console import Console
    from textual.widgets import Static

    widget = app.screen.query_one(selector)
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()


def background_threads() -> list:
    """The explorer's background-load threads still alive (`--background N` names them reqscope-bg-*)."""
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("reqscope-bg-") and t.is_alive()]
