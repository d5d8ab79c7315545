"""Timestamps for a run of device work: CUDA events on CUDA, the host clock on the CPU.

On CUDA the host returns from a kernel launch long before the kernel ends, so host clocks
around a step measure launching, not running. An event recorded in the stream after each step
completes when the step does; the time between consecutive events is the step's share of the
device timeline, gaps included, so their sum is the honest wall time of the run. On the CPU
operations are synchronous and the host clock already says that.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """Mark after each step; read durations (ms) between consecutive marks at the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[torch.cuda.Event] = []
        self._times: list[float] = []

    def mark(self) -> None:
        """Record the point after the work enqueued so far."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        else:
            self._times.append(time.perf_counter())

    @property
    def marks(self) -> int:
        """How many marks were recorded."""
        return len(self._events) if self.cuda else len(self._times)

    def durations_ms(self) -> list[float]:
        """Milliseconds between each mark and the next (waits for the device on CUDA)."""
        if self.cuda:
            if self._events:
                self._events[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self._events, self._events[1:], strict=False)]
        return [(b - a) * 1000.0 for a, b in zip(self._times, self._times[1:], strict=False)]

    def total_ms(self) -> float:
        """Milliseconds from the first mark to the last."""
        return sum(self.durations_ms())
