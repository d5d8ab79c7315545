"""What this session's runs measured, kept so the panels can set the run on screen beside the others."""

from __future__ import annotations

from dataclasses import dataclass, field

from minengine.engine.events import DoneEvent, Event, PrefillEvent
from reqscope.ui.run.figures.latency import LatencyFigures, RunTtft
from reqscope.ui.run.figures.layout_compare import MeasuredLayout, measured_layout
from reqscope.ui.run.view import RunView


@dataclass
class RunHistory:
    """Per KV layout the newest run's measurement, and every run's prefill and TTFT."""

    measured: dict[str, MeasuredLayout] = field(default_factory=dict)
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens computed, prefill ms) per run
    ttft: list[RunTtft] = field(default_factory=list)  # every finished run's TTFT and prefix cache reuse

    def record(self, event: Event) -> None:
        """Keep what a live run's event adds: its prefill time, and its TTFT once it has finished."""
        if isinstance(event, PrefillEvent):
            self.prefill.append((event.prompt_tokens - event.reused_tokens, event.duration_ms))
        elif isinstance(event, DoneEvent):
            result = event.result
            metrics = result.engine_metrics or result.metrics
            if metrics is not None and not result.error:
                usage = result.usage
                self.ttft.append(RunTtft(result.request_id, usage.prompt_tokens, usage.cached_tokens, metrics.ttft_ms))

    def measure(self, view: RunView, request_id: str, latency: LatencyFigures) -> None:
        """Keep the layout measurement of the run on screen, once it has one."""
        measured = measured_layout(view, request_id, latency)
        if measured is not None:
            self.measured[measured.layout] = measured
