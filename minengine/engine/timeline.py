"""One request's timeline on one monotonic clock.

Events are named as the seeds name them (`client_send`, `server_arrival`, ...,
`first_visible_token`, `last_visible_token`, `completed`) plus one `token` event per streamed
token. Stage durations, the CSV export and the Perfetto trace are all derived from this list,
so every number the tool shows reconciles with every other.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

# The lifecycle stages as spans between timeline events: (stage, start event, end event).
STAGE_SPANS: tuple[tuple[str, str, str], ...] = (
    ("gateway", "server_arrival", "validated"),
    ("template", "validated", "templated"),
    ("tokenize", "templated", "tokenized"),
    ("admit", "tokenized", "scheduler_admit"),
    ("prefix_cache", "prefix_cache_start", "prefix_cache_end"),
    ("prefill", "prefill_start", "prefill_end"),
    ("decode", "prefill_end", "last_visible_token"),
    ("complete", "last_visible_token", "completed"),
)
ALL_STAGES = tuple(name for name, _, _ in STAGE_SPANS)
# The seeds' lifecycle stages, without the newer prefix cache stage (between admit and prefill),
# which is in ALL_STAGES, the events, every export and `Timeline.stages()`. The explorer's
# pipeline strip draws ALL_STAGES (a trace recorded before the stage, without it).
STAGES = tuple(name for name in ALL_STAGES if name != "prefix_cache")


@dataclass(frozen=True)
class TimelineEvent:
    """A named instant, in milliseconds since the timeline's origin."""

    name: str
    t_ms: float
    detail: str = ""


@dataclass(frozen=True)
class StageTiming:
    """A lifecycle stage as a span on the timeline."""

    name: str
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        """Length of the span."""
        return self.end_ms - self.start_ms


class Timeline:
    """Append-only list of events timestamped with `time.perf_counter_ns`."""

    def __init__(self, origin_ns: int | None = None) -> None:
        self.origin_ns = time.perf_counter_ns() if origin_ns is None else origin_ns
        self.events: list[TimelineEvent] = []
        self._index: dict[str, float] = {}

    def now_ms(self) -> float:
        """Milliseconds since the origin, on the timeline's clock."""
        return (time.perf_counter_ns() - self.origin_ns) / 1e6

    def mark(self, name: str, detail: str = "", t_ms: float | None = None) -> float:
        """Record `name` now (or at `t_ms`); named events other than `token` happen once."""
        t = self.now_ms() if t_ms is None else t_ms
        # Events recorded after the fact (last_visible_token) still land in time order.
        at = bisect.bisect_right([e.t_ms for e in self.events], t) if t_ms is not None else len(self.events)
        self.events.insert(at, TimelineEvent(name, t, detail))
        if name != "token":
            self._index[name] = t
        return t

    def time_of(self, name: str) -> float | None:
        """When `name` happened, or None."""
        return self._index.get(name)

    def token_times(self) -> list[float]:
        """Timestamps of every streamed-token event, in order."""
        return [e.t_ms for e in self.events if e.name == "token"]

    def stages(self) -> tuple[StageTiming, ...]:
        """Every stage whose both ends have happened, in lifecycle order."""
        out = []
        for stage, a, b in STAGE_SPANS:
            ta, tb = self._index.get(a), self._index.get(b)
            if ta is not None and tb is not None:
                out.append(StageTiming(stage, ta, tb))
        return tuple(out)
