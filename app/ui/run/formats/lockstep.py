"""Two engines run the same request in step, each teacher-forced on the same tokens.

At every decode step each session stops at `StepReady` with its next-token logits waiting
(`RequestSession.pending_logits`, the model's own, before any sampling rule): both are read,
compared (`agreement.step_agreement`), and each session is forced to commit the run on
screen's token there, so step i+1 of both conditions on the same prefix. A session waits while
the other one steps; that wait is held (`RequestSession.hold`), so each run's TTFT and tok/s
stay its own engine's time. The prefix cache stays out (the baseline engine would otherwise
reuse the prompt the run on screen left behind, and only it would skip its prefill).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, Event, RequestResult, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.session import RequestSession
from reqscope.other_formats import run_label
from reqscope.ui.base import renewed
from reqscope.ui.run.formats.agreement import (
    EngineCost,
    FormatComparison,
    FormatRun,
    StepAgreement,
    step_agreement,
)


@dataclass
class _Side:
    """One engine's session and what it has yielded so far."""

    engine: Engine
    session: RequestSession
    events: Iterator[Event]
    tokens: list[TokenEvent] = field(default_factory=list)
    result: RequestResult | None = None

    def to_step(self) -> bool:
        """Pull events up to the next waiting step (True) or the end (False)."""
        for event in self.events:
            if isinstance(event, TokenEvent):
                self.tokens.append(event)
            elif isinstance(event, DoneEvent):
                self.result = event.result
            elif isinstance(event, StepReady):
                return True
        return False

    def finish(self) -> None:
        """Run to the end; a step past the planned tokens is cancelled."""
        while self.to_step():
            self.session.cancel()

    def measured(self) -> FormatRun:
        result = self.result
        metrics = (result.engine_metrics or result.metrics) if result is not None else None
        read = [t.bytes_read for t in self.tokens if t.bytes_read is not None]
        return FormatRun(
            format=run_label(self.engine),
            why=self.engine.weights.why,
            tokens=len(self.tokens),
            ttft_ms=metrics.ttft_ms if metrics is not None else None,
            decode_tokens_per_s=metrics.decode_output_tokens_per_second if metrics is not None else None,
            weight_bytes_per_step=read[-1].weights if read else None,
            bytes_per_step=sum(r.total for r in read) / len(read) if read else None,
        )


def compare_on_tokens(
    baseline: Engine,
    other: Engine,
    request: GenerationRequest,
    tokens: tuple[int, ...],
    *,
    cost: EngineCost | None = None,
    publish: Callable[[FormatComparison], object] = lambda comparison: None,
    cancelled: threading.Event | None = None,
) -> FormatComparison:
    """`request` through both engines, forced on `tokens`; `publish` gets the comparison after every step."""
    cancelled = cancelled or threading.Event()
    forced = renewed(request, max_tokens=len(tokens), min_tokens=min(request.min_tokens, len(tokens)))
    steps: list[StepAgreement] = []
    with _no_prefix_cache(baseline), _no_prefix_cache(other):
        sides = [_side(baseline, forced), _side(other, replace(forced, request_id=forced.request_id + "-other"))]
        try:
            for index, token in enumerate(tokens):
                if cancelled.is_set() or not _all_at_step(sides):
                    break
                a, b = (side.session.pending_logits for side in sides)
                assert a is not None and b is not None  # a session at StepReady holds its logits
                steps.append(step_agreement(index, a, b))
                for side in sides:
                    side.session.force_next(token)
                publish(_comparison(request, sides, steps, len(tokens), cost, finished=False))
            for side in sides:
                if cancelled.is_set():
                    side.session.cancel()
                side.finish()
        finally:
            for side in sides:
                side.session.cancel()
                side.events.close()  # type: ignore[attr-defined]  # releases the cache and the admission
    comparison = _comparison(request, sides, steps, len(tokens), cost, finished=not cancelled.is_set())
    publish(comparison)
    return comparison


def _all_at_step(sides: list[_Side]) -> bool:
    """Each side to its next waiting step, held there at once: the other sides' steps are not its time."""
    for side in sides:
        if not side.to_step():
            return False
        side.session.hold()
    return True


def _side(engine: Engine, request: GenerationRequest) -> _Side:
    session = engine.start(request)
    return _Side(engine, session, iter(session))


def _comparison(
    request: GenerationRequest, sides: list[_Side], steps: list[StepAgreement], planned: int,
    cost: EngineCost | None, *, finished: bool,
) -> FormatComparison:  # fmt: skip
    return FormatComparison(request.request_id, sides[0].measured(), sides[1].measured(), tuple(steps), planned,
                            cost, finished)  # fmt: skip


@contextmanager
def _no_prefix_cache(engine: Engine) -> Iterator[None]:
    """The engine without its prefix cache for the block, the kept blocks left as they were."""
    kept = engine.prefix_cache
    engine.prefix_cache = None  # read at each admission (see RequestSession)
    try:
        yield
    finally:
        engine.prefix_cache = kept
