"""A recorded run, walked forward and back one decode step at a time, without a model.

The cursor counts the events shown. Its resting points are the recorded `StepReady` events
(the moments the live run could pause at) and the end; the view at any point is the fold of
the events before it, so stepping back is exact.
"""

from __future__ import annotations

from minengine.engine.events import Event, StepReady, TokenEvent
from minengine.record.trace_io import TraceHeader
from reqscope.ui.run.view import RunView


class ReplayRun:
    """Recorded events and a cursor over them."""

    def __init__(self, header: TraceHeader, events: list[Event]) -> None:
        self.header = header
        self.events = events
        self.stops = [i + 1 for i, e in enumerate(events) if isinstance(e, StepReady)]
        if not self.stops or self.stops[-1] != len(events):
            self.stops.append(len(events))
        self.cursor = self.stops[0]

    def view(self) -> RunView:
        """What the live run showed at the cursor."""
        return RunView.of(self.events[: self.cursor])

    @property
    def at_end(self) -> bool:
        """True when every event is shown."""
        return self.cursor >= len(self.events)

    @property
    def at_start(self) -> bool:
        """True at the first resting point."""
        return self.cursor <= self.stops[0]

    def forward(self) -> bool:
        """Move to the next resting point; False when already at the end."""
        later = [s for s in self.stops if s > self.cursor]
        if not later:
            return False
        self.cursor = later[0]
        return True

    def back(self) -> bool:
        """Move to the previous resting point; False when already at the first."""
        earlier = [s for s in self.stops if s < self.cursor]
        if not earlier:
            return False
        self.cursor = earlier[-1]
        return True

    def to_start(self) -> None:
        """Jump to the first resting point."""
        self.cursor = self.stops[0]

    def to_end(self) -> None:
        """Jump past the last event."""
        self.cursor = len(self.events)

    def pending_token(self) -> TokenEvent | None:
        """The token the recorded run committed at the step shown as waiting, if any."""
        if self.cursor == 0 or not isinstance(self.events[self.cursor - 1], StepReady):
            return None
        for event in self.events[self.cursor :]:
            if isinstance(event, TokenEvent):
                return event
        return None

    def next_delay_ms(self) -> float:
        """Recorded engine time between the token just shown and the next one (for playback).

        A step held while recording (paused, stepped) is not played back as a wait.
        """
        shown = [e for e in self.events[: self.cursor] if isinstance(e, TokenEvent)]
        upcoming = self.pending_token()
        if not shown or upcoming is None:
            return 0.0
        return max(upcoming.t_ms - shown[-1].t_ms - upcoming.held_ms, 0.0)
