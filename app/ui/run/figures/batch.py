"""The batch figures the batch panel and the readout draw: the request's step on screen among the others.

The facts come with the request's own events (`TokenEvent.batch`, `PrefillEvent.chunks`,
`PreemptEvent`, `RequestResult.batch`), so a replay draws what the live run drew. The step on
screen is the one behind the latest token (before the first decode step: the prompt's last chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.batch_facts import BatchStep, BatchSummary, PreemptEvent, PrefillChunk
from reqscope.ui.run.view import RunView

RECENT = 240  # decode steps the charts draw at most (the widest panel's columns)


@dataclass(frozen=True)
class BatchFigures:
    """The step on screen, the recent steps, the prompt's chunks, the preemptions and the run's summary."""

    step: BatchStep | None  # None before any step that kept its facts
    label: str  # which step it is: "token 12", "prefill chunk 2 of 3"
    recent: tuple[BatchStep, ...]  # the latest decode steps, oldest first (at most RECENT)
    chunks: tuple[PrefillChunk, ...]
    preemptions: tuple[tuple[int, PreemptEvent], ...]  # (tokens out before it, the event)
    summary: BatchSummary  # the finished request's, else the steps so far

    @property
    def slowdown(self) -> float | None:
        """The step's time over a step of one sequence alone (None without both)."""
        s = self.step
        if s is None or not s.solo_step_ms or s.step_ms <= 0:
            return None
        return s.step_ms / s.solo_step_ms


def batch_figures(view: RunView) -> BatchFigures:
    """The figures for `view` as it stands."""
    chunks = view.prefill.chunks if view.prefill is not None else ()
    decode = [t.batch for t in view.tokens if t.batch is not None]
    step, label = None, ""
    latest = next((t for t in reversed(view.tokens) if t.batch is not None), None)
    if latest is not None:
        step, label = latest.batch, f"token {latest.index + 1}"
    elif chunks:
        step, label = chunks[-1].step, f"prefill chunk {len(chunks)} of {len(chunks)}"
    preemptions = tuple(view.preemptions)
    summary = view.result.batch if view.result is not None and view.result.batch is not None else (
        BatchSummary.of([c.step for c in chunks] + decode, len(chunks), len(preemptions)))
    return BatchFigures(step, label, tuple(decode[-RECENT:]), tuple(chunks), preemptions, summary)
