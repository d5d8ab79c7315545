"""The explorer over a recorded trace, without a model: step it forward and back, or play it.

Playback shows one recorded step after another at the recorded pace (the engine's time
between tokens, bounded so that a long gap does not stall it and a short one stays visible).
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from textual.timer import Timer

from minengine.engine.events import Event
from minengine.record.trace_io import TraceHeader
from minengine.sampling.params import SamplingParams
from reqscope.ui.keys import REPLAY, bindings
from reqscope.ui.run.app import RunExplorer
from reqscope.ui.run.frame import Frame, StepSubject
from reqscope.ui.run.inside.shown import ShownInspection, recorded_views, replay_inspection
from reqscope.ui.run.replay import ReplayRun
from reqscope.ui.run.sampling_form import SamplingChoice
from reqscope.ui.run.status_line import status_text
from reqscope.ui.run.step_subject import replay_subject
from reqscope.ui.run.view import RunView

_PLAYBACK_MS = (20.0, 500.0)  # replay plays at the recorded pace, within these bounds per token


class ReplayExplorer(RunExplorer):
    """The explorer over the events of a trace (`header` names the model and cache they ran with)."""

    BINDINGS = bindings(REPLAY)
    RECORDED = True

    def __init__(self, header: TraceHeader, events: list[Event], *, source_name: str = "", **options: Any) -> None:
        """`source_name` (the trace's file name) goes on the status line; `options` go to `RunExplorer`."""
        recording = ReplayRun(header, events)
        view = recording.view()
        recorded = next((e.trace.params for e in events if getattr(e, "trace", None)), SamplingParams())
        super().__init__(mode=REPLAY, header=header,
                         sampling=SamplingChoice(recorded, view.admit.max_tokens if view.admit else 0), **options)
        self.recording = recording  # the events, and the cursor over them
        self.source_name = source_name
        self.view = view
        self._play_timer: Timer | None = None
        self._shares_engine = RunView.of(events).batched  # the whole trace: the layout stays as the cursor moves
        self._recorded_inside = recorded_views(events)  # the inside views some recorded step kept

    @property
    def playing(self) -> bool:
        """True while the replay plays itself forward."""
        return self._play_timer is not None

    # -- the run: a cursor over recorded events --------------------------------------------------

    def _begin(self) -> None:
        pass  # the first recorded step is on screen from the start

    def _take_events(self) -> None:
        pass  # every event is here already: the cursor shows them

    def _streaming(self) -> bool:
        return False

    def _show_cursor(self) -> None:
        self.view = self.recording.view()
        self._invalidate()

    def _play_next(self) -> None:
        """Show the next recorded step after the recorded gap (bounded), then schedule the one after."""
        self._play_timer = None
        if not self.recording.forward():
            self._invalidate()
            return
        self._show_cursor()
        low, high = _PLAYBACK_MS
        delay = min(max(self.recording.next_delay_ms(), low), high) / 1000
        self._play_timer = self.set_timer(delay, self._play_next)

    def _stop_playing(self) -> None:
        if self._play_timer is not None:
            self._play_timer.stop()
            self._play_timer = None

    def _stop(self) -> None:
        self._stop_playing()

    # -- what the frame shows --------------------------------------------------------------------

    def _status_line(self, frame: Frame) -> RenderableType:
        return status_text(frame, self.source_name, self.playing)

    def _request_id(self) -> str:
        if self.view.result is not None:
            return self.view.result.request_id
        gateway = self.recording.events[0] if self.recording.events else None
        return getattr(gateway, "detail", "") or "replay"

    def _state(self) -> str:
        return "replay"

    def _subject(self) -> StepSubject | None:
        return replay_subject(self.recording, self._shown_params())

    def _recorded_events(self) -> list[Event]:
        return list(self.recording.events)

    def _batched(self) -> bool:
        return self._shares_engine

    def _inside_views(self) -> tuple[str, ...]:
        return self._recorded_inside

    def _inspection(self) -> ShownInspection | None:
        return replay_inspection(self.recording, self.view)

    def _follow_inside(self) -> None:
        pass  # a recording captures nothing: it shows what it kept

    # -- actions ---------------------------------------------------------------------------------

    def action_toggle_run(self) -> None:
        """Play or stop."""
        if self.playing:
            self._stop_playing()
        else:
            if self.recording.at_end:
                self.recording.to_start()
            self._play_next()
        self._invalidate()

    def action_step(self) -> None:
        """One step forward."""
        self._stop_playing()
        if not self.recording.forward():
            self.notify("end of the recorded run")
        self._show_cursor()

    def action_step_back(self) -> None:
        """One step back."""
        self._stop_playing()
        if not self.recording.back():
            self.notify("already at the first step")
        self._show_cursor()

    def action_first_step(self) -> None:
        """The first step."""
        self._stop_playing()
        self.recording.to_start()
        self._show_cursor()

    def action_last_step(self) -> None:
        """The end of the run."""
        self._stop_playing()
        self.recording.to_end()
        self._show_cursor()
