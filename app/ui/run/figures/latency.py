"""Running latency figures for the latency panel and the readout, from the tokens seen so far.

While the request runs, the figures come from the same formulas the engine applies at the end
(`minengine.engine.metrics`), fed with the visible tokens so far; once it is done they are the
engine's own result, so the panel's last frame equals the exported metrics.

Two clocks: `wall` is what a client would have seen, every gap as it happened; `engine` is the
same formulas over the token times with the time the run was held at a step (paused, stepped,
a form open) taken out. The explorer shows the engine's figures, the held time beside them:
a step held for ten seconds is the person's time, not a ten-second inter-token latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from minengine.engine.metrics import ItlStats, RequestMetrics, itl_stats, request_metrics, without_held
from minengine.errors import ReqscopeError
from reqscope.ui.run.view import RunView

# The timeline's origin is the moment the session was created, and `client_send` is marked
# right then, so the send time is 0 ms on every event's clock.
SEND_MS = 0.0


@dataclass(frozen=True)
class LatencyFigures:
    """What the latency panel and the readout print; None where there is not enough data yet."""

    engine: RequestMetrics | None  # on the engine's clock: held time taken out
    wall: RequestMetrics | None  # on the wall clock, as a client would have seen it
    held_ms: float  # time the run was held at a step so far (0 when nobody paused it)
    last_itl_ms: float | None  # the latest gap between visible tokens, engine clock
    wall_last_itl_ms: float | None  # the same gap on the wall clock
    itls_ms: tuple[float, ...]  # every gap between streamed (visible) tokens, in order, engine clock
    itl: ItlStats | None  # their summary, engine clock
    prefill_ms: float | None
    prompt_tokens: int | None
    step_ms: tuple[float, ...]  # model + sampler time per generated token
    reused_tokens: int = 0  # prompt tokens the prefix cache supplied: prefill computed the rest

    @property
    def computed_tokens(self) -> int | None:
        """Prompt tokens prefill computed (all of them without a prefix cache hit)."""
        return None if self.prompt_tokens is None else self.prompt_tokens - self.reused_tokens

    @property
    def prefill_ms_per_token(self) -> float | None:
        """Prefill time divided by prompt length."""
        if self.prefill_ms is None or not self.prompt_tokens:
            return None
        return self.prefill_ms / self.prompt_tokens


def latency_figures(view: RunView) -> LatencyFigures:
    """The figures for `view` as it stands."""
    shown = [(t.t_ms, held) for t, held in zip(view.tokens, view.held_totals, strict=True) if t.text]
    times = [t for t, _ in shown]
    engine_times = list(without_held(times, [held for _, held in shown]))
    gaps = _gaps(engine_times)
    wall_gaps = _gaps(times)
    result = view.result
    if result is not None:
        # Traces recorded before engine metrics were kept have none: nobody held those runs apart.
        wall, engine = result.metrics, result.engine_metrics or result.metrics
    else:
        wall, engine = _running_metrics(times), _running_metrics(engine_times)
    prefill = view.prefill
    return LatencyFigures(
        engine=engine,
        wall=wall,
        held_ms=view.held_ms,
        last_itl_ms=gaps[-1] if gaps else None,
        wall_last_itl_ms=wall_gaps[-1] if wall_gaps else None,
        itls_ms=gaps,
        itl=engine.itl if engine is not None and engine.itl is not None else itl_stats(gaps),
        prefill_ms=prefill.duration_ms if prefill else None,
        prompt_tokens=prefill.prompt_tokens if prefill else None,
        step_ms=tuple(t.step_ms for t in view.tokens),
        reused_tokens=view.reused_tokens,
    )


class RunTtft(NamedTuple):
    """One finished run's TTFT, kept across runs so a prefix cache hit can be set beside a miss."""

    request_id: str
    prompt_tokens: int
    reused_tokens: int
    ttft_ms: float


def ttft_without_hit(history: tuple[RunTtft, ...], request_id: str, prompt_tokens: int) -> RunTtft | None:
    """The latest other run of the same prompt length that reused nothing, or None."""
    for run in reversed(history):
        if run.request_id != request_id and run.prompt_tokens == prompt_tokens and run.reused_tokens == 0:
            return run
    return None


def _gaps(times: list[float]) -> tuple[float, ...]:
    return tuple(b - a for a, b in zip(times, times[1:], strict=False))


def _running_metrics(times: list[float]) -> RequestMetrics | None:
    if not times:
        return None
    try:
        return request_metrics(SEND_MS, times[0], times[-1], len(times), times)
    except ReqscopeError:
        return None  # e.g. two tokens on the same clock tick: wait for the next one
