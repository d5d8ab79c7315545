"""The roofline figures the latency panel draws: the latest decode step and the run so far against the
read ceiling, and the prefill against the compute ceiling, with the rows a step at which compute binds.

The bytes come with each token event (`TokenEvent.bytes_read`), the ceilings and the model's
arithmetic (`FlopShape`) with the run's header (those `reqscope calibrate` kept for this machine,
or those a trace recorded), so a replay draws what the live run drew.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.roofline import (
    PrefillRoofline,
    RooflineSummary,
    StepBytes,
    StepRoofline,
    decode_roofline,
    prefill_roofline,
    step_roofline,
)
from minengine.record.trace_io import TraceHeader
from reqscope.bench.ceiling import CALIBRATE_HINT, COMPUTE_HINT
from reqscope.ui.run.view import RunView


@dataclass(frozen=True)
class RooflineFigures:
    """The latest decode step's bytes (and its time at the ceiling), the run's summary, and the ceiling's origin."""

    index: int  # the latest decode step's token
    read: StepBytes
    step: StepRoofline | None  # None without a ceiling
    run: RooflineSummary
    ceiling_note: str  # where the ceiling came from and when, or why there is none


def roofline_figures(view: RunView, header: TraceHeader, replay: bool) -> RooflineFigures | None:
    """The figures for `view` as it stands; None before the first decode step, and in traces without bytes."""
    steps = [t for t in view.tokens if t.bytes_read is not None]
    ceiling = header.read_ceiling
    run = decode_roofline(((t.bytes_read, t.read_step_ms) for t in steps), ceiling)  # type: ignore[misc]
    if run is None:
        return None
    last = steps[-1]
    assert last.bytes_read is not None
    if ceiling is not None:
        note = f"{ceiling.source}, {ceiling.measured_at}"
    else:
        note = "no read ceiling in this trace" if replay else f"no read ceiling for this machine: {CALIBRATE_HINT}"
    step = None if ceiling is None else step_roofline(last.bytes_read, last.read_step_ms, ceiling)
    return RooflineFigures(last.index, last.bytes_read, step, run, note)


@dataclass(frozen=True)
class PrefillFigures:
    """The prefill against the compute ceiling (and the crossover), and where the ceiling came from."""

    roofline: PrefillRoofline
    ceiling_note: str  # where the compute ceiling came from and when, or why there is none


def prefill_figures(view: RunView, header: TraceHeader, replay: bool) -> PrefillFigures | None:
    """The prefill's figures; None before prefill ends, and in traces without the model's arithmetic."""
    prefill, shape = view.prefill, header.flop_shape
    if prefill is None or shape is None:
        return None
    computed = max(prefill.prompt_tokens - prefill.reused_tokens, 1)
    rows = max((c.tokens for c in prefill.chunks), default=computed)  # its largest step; one step without chunks
    compute = header.compute_ceiling
    fig = prefill_roofline(shape, computed, prefill.reused_tokens, prefill.duration_ms, rows, compute,
                           header.read_ceiling)  # fmt: skip
    if compute is not None:
        note = f"{compute.source}, {compute.measured_at}"
    else:
        note = "no compute ceiling in this trace" if replay else f"compute ceiling not measured: run {COMPUTE_HINT}"
    return PrefillFigures(fig, note)
