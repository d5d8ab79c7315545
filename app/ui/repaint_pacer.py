"""When the next repaint may happen, so that drawing never takes more than its share of a core.

Textual draws the screen some time after a repaint is asked for, so the cost of one repaint
is read as all the UI thread's CPU time between two repaints (drawing, mostly: while the
engine decodes, the UI thread does little else). The next repaint then waits cost / duty, at
least 1 / max_hz and at most `slowest_s`: a fast terminal repaints up to max_hz times a
second, a slow one less often instead of taking CPU and the GIL from the engine's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RepaintPacer:
    """Records repaints and says how long to wait before the next one."""

    def __init__(
        self,
        max_hz: float = 30.0,
        duty: float = 0.08,
        slowest_s: float = 2.0,
        wall: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self.max_hz = max_hz
        self.duty = duty
        self.slowest_s = slowest_s
        self._wall = wall
        self._cpu = cpu
        self._last_wall = float("-inf")
        self._last_cpu: float | None = None
        self.cost_s = 0.0  # UI-thread CPU seconds between the last two repaints

    def repainting(self) -> None:
        """Note that a repaint starts now (call from the UI thread)."""
        cpu = self._cpu()
        if self._last_cpu is not None:
            self.cost_s = cpu - self._last_cpu
        self._last_cpu = cpu
        self._last_wall = self._wall()

    @property
    def interval_s(self) -> float:
        """The spacing between repaints that keeps drawing within the duty."""
        return min(max(1 / self.max_hz, self.cost_s / self.duty), self.slowest_s)

    def wait_s(self) -> float:
        """Seconds until the next repaint is due (0 or less: now)."""
        return self._last_wall + self.interval_s - self._wall()
