"""Progress events: the default model fetched, verified and converted, and a first load laying out
the CPU weights.

Work comes in stages ("phases"): `download` and `verify` (bytes) in a pull, `convert` (tensors)
in a GGUF conversion, `layout` (checkpoint tensors laid out) and `cache` (bytes written) when a
first load builds the CPU weight layout. A stage is reported by a `Stage`, whose events all
carry its start time, so a display can show rate and ETA without keeping clocks of its own, and
whose last event is marked `finished`. Sources report every step; displays decide how often to
draw (a bar updated in place, or one line when a stage starts and one when it ends).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

BYTES = "B"
TENSORS = "tensors"

# What a display calls each stage (the stage names themselves stay short for tests and logs).
STAGE_TITLES = {
    "download": "download",
    "verify": "verify sha256",
    "convert": "convert",
    "layout": "lay out weights",
    "cache": "write layout cache",
}


@dataclass(frozen=True)
class PullProgress:
    """One step of a stage of work (a pull, a GGUF conversion, a layout-cache build).

    `done` and `total` count `unit`s (bytes or tensors); `total` is None while unknown.
    `started` is the stage's start on `time.monotonic()`'s clock (None from sources that do not
    time their stages); `finished` marks the stage's last event.
    """

    stage: str
    done: int
    total: int | None
    message: str
    unit: str = BYTES
    started: float | None = None
    finished: bool = False

    @property
    def fraction(self) -> float | None:
        """Share of the stage that is finished, or None while the total is unknown."""
        if self.finished:
            return 1.0
        if not self.total:
            return None
        return min(1.0, self.done / self.total)

    @property
    def title(self) -> str:
        """The stage as a display names it."""
        return STAGE_TITLES.get(self.stage, self.stage)

    def elapsed(self, now: float | None = None) -> float | None:
        """Seconds since the stage started (None when the source did not say when)."""
        if self.started is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - self.started)

    def rate(self, now: float | None = None) -> float | None:
        """Units per second since the stage started; None until there is something to divide."""
        elapsed = self.elapsed(now)
        if elapsed is None or elapsed < 1e-3 or self.done <= 0:
            return None
        return self.done / elapsed

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the average rate so far; None while the rate or the total is unknown."""
        rate = self.rate(now)
        if rate is None or not self.total or self.finished:
            return None
        return max(0.0, (self.total - self.done) / rate)


ProgressCallback = Callable[[PullProgress], None]
# A display that hears plain status messages ("loading ...") besides stage events.
StatusCallback = Callable[[PullProgress | str], None]


def report_to(callback: ProgressCallback | None) -> ProgressCallback:
    """A callable that forwards events to `callback`, or drops them when there is none."""
    return callback if callback is not None else _ignore


def _ignore(_event: PullProgress) -> None:
    pass


class Stage:
    """One stage of work, reported to a callback: a first event when it starts, one per `advance`,
    and a last one (`finished`) from `finish`. Every event carries the stage's start time."""

    def __init__(
        self,
        report: ProgressCallback | None,
        stage: str,
        total: int | None = None,
        unit: str = BYTES,
        message: str = "",
        clock: Callable[[], float] = time.monotonic,  # the displays' clock; a test's fake one
    ) -> None:
        self._report = report_to(report)
        self.last = PullProgress(stage, 0, total, message, unit, clock())
        self._report(self.last)

    def advance(self, done: int, message: str | None = None, total: int | None = None) -> None:
        """Report `done` units so far (and the total, once it becomes known)."""
        self._emit(done, message, total, finished=False)

    def finish(self, message: str | None = None, done: int | None = None) -> None:
        """Report the stage's end: everything done unless `done` says otherwise."""
        last = self.last
        if done is None:
            done = last.total if last.total is not None else last.done
        self._emit(done, message, max(done, last.total or 0), finished=True)

    def _emit(self, done: int, message: str | None, total: int | None, *, finished: bool) -> None:
        last = self.last
        self.last = replace(
            last,
            done=done,
            total=last.total if total is None else total,
            message=last.message if message is None else message,
            finished=finished,
        )
        self._report(self.last)


def paced(callback: StatusCallback, interval: float = 0.05) -> StatusCallback:
    """`callback`, hearing a stage's steps at most once per `interval` seconds.

    A stage's first and last events always pass, and so do plain messages; a step that arrives
    too soon after the last one passed is dropped (the next one carries its progress anyway).
    For displays that pay per event, such as a UI fed across threads.
    """
    last_sent: dict[tuple[str, float | None], float] = {}

    def forward(item: PullProgress | str) -> None:
        if isinstance(item, PullProgress) and not item.finished:
            key, now = (item.stage, item.started), time.monotonic()
            if key in last_sent and now - last_sent[key] < interval:
                return
            last_sent[key] = now
        callback(item)

    return forward
