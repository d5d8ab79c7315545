"""Running latency figures for the latency panel, from the tokens seen so far.

While the request runs, the figures come from the same formulas the engine applies at the end
(`minengine.engine.metrics`), fed with the visible tokens so far; once it is done they are the
engine's own result, so the panel's last frame equals the exported metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.metrics import ItlStats, RequestMetrics, itl_stats, request_metrics
from minengine.errors import ReqscopeError
from reqscope.ui.run.view import RunView

# The timeline's origin is the moment the session was created, and `client_send` is marked
# right then, so the send time is 0 ms on every event's clock.
SEND_MS = 0.0


@dataclass(frozen=True)
class LatencyFigures:
    """What the latency panel prints; None where there is not enough data yet."""

    metrics: RequestMetrics | None
    last_itl_ms: float | None
    itls_ms: tuple[float, ...]  # every gap between streamed (visible) tokens, in order
    itl: ItlStats | None
    prefill_ms: float | None
    prompt_tokens: int | None
    step_ms: tuple[float, ...]  # model + sampler time per generated token

    @property
    def prefill_ms_per_token(self) -> float | None:
        """Prefill time divided by prompt length."""
        if self.prefill_ms is None or not self.prompt_tokens:
            return None
        return self.prefill_ms / self.prompt_tokens


def latency_figures(view: RunView) -> LatencyFigures:
    """The figures for `view` as it stands."""
    visible = view.visible_tokens
    times = [t.t_ms for t in visible]
    gaps = tuple(b - a for a, b in zip(times, times[1:], strict=False))
    metrics = view.result.metrics if view.result is not None else _running_metrics(times)
    prefill = view.prefill
    return LatencyFigures(
        metrics=metrics,
        last_itl_ms=gaps[-1] if gaps else None,
        itls_ms=gaps,
        itl=metrics.itl if metrics is not None and metrics.itl is not None else itl_stats(gaps),
        prefill_ms=prefill.duration_ms if prefill else None,
        prompt_tokens=prefill.prompt_tokens if prefill else None,
        step_ms=tuple(t.step_ms for t in view.tokens),
    )


def _running_metrics(times: list[float]) -> RequestMetrics | None:
    if not times:
        return None
    try:
        return request_metrics(SEND_MS, times[0], times[-1], len(times), times)
    except ReqscopeError:
        return None  # e.g. two tokens on the same clock tick: wait for the next one
