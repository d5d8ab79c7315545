"""Many asks for a repaint, one repaint; while a run streams, repaints wait for the pacer.

Both explorers take their run's events from an inbox and draw every panel from one frame. A
repaint asked for while the run streams waits until the pacer allows it (`RepaintPacer`), and
the events that arrive meanwhile stay in the inbox until the repaint takes them all at once:
the producer thread wakes the UI only after its last wake-up was taken, so a burst of tokens
costs one message and one repaint. A repaint that is not paced (the run is held or over, or a
key asked for it) takes the inbox first for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable

from textual.app import App
from textual.timer import Timer

from reqscope.ui.repaint_pacer import RepaintPacer


class RepaintScheduler:
    """Coalesces repaint requests and schedules each repaint now or when the pacer allows."""

    def __init__(
        self,
        app: App,
        pacer: RepaintPacer,
        *,
        take: Callable[[], object],
        draw: Callable[[], object],
        streaming: Callable[[], bool],
    ) -> None:
        self.pacer = pacer
        self.dirty = True  # a change waits for the next repaint
        self._app = app
        self._take = take  # fold the inbox into the view; must ask for a repaint only when it took something
        self._draw = draw  # draw every panel from the current state
        self._streaming = streaming  # True while events keep arriving: the pacer applies
        self._pending = False
        self._now = False
        self._timer: Timer | None = None

    @property
    def paced(self) -> bool:
        """True while a paced repaint is scheduled (it will take the inbox itself)."""
        return self._timer is not None

    def invalidate(self, now: bool = False) -> None:
        """Ask for a repaint once the current handler is done; `now` skips the pacer (a key's)."""
        self.dirty = True
        self._now = self._now or now
        if not self._pending:
            self._pending = True
            self._app.call_next(self._flush)

    def _flush(self) -> None:
        self._pending = False
        now, self._now = self._now, False
        if not self.dirty:
            return
        wait = self.pacer.wait_s()
        if wait > 0 and not now and self._streaming():
            if self._timer is None:
                self._timer = self._app.set_timer(wait, self._paced_repaint)
            return
        if self._timer is not None:  # held, finished, idle or a key: show it now
            self._timer.stop()
            self._timer = None
        self._take()
        self._repaint()

    def _paced_repaint(self) -> None:
        self._timer = None
        self._take()  # the events that waited for this repaint
        self._repaint()

    def _repaint(self) -> None:
        if self.dirty:
            self.dirty = False
            self._draw()
