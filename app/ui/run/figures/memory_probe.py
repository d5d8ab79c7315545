"""Process and device memory, read at most a few times a second.

psutil's RSS read is a syscall and CUDA's allocator query a driver call; neither belongs in
every repaint, so readings are cached for `interval_s`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class MemoryReading:
    """Resident memory of this process and, on CUDA, what the allocator holds."""

    rss_bytes: int
    device: str
    device_bytes: int | None


class MemoryProbe:
    """Cached memory readings for one engine's device."""

    def __init__(self, device: str, device_bytes: Callable[[], int | None], interval_s: float = 0.5) -> None:
        self.device = device
        self._device_bytes = device_bytes
        self._process = psutil.Process(os.getpid())
        self._interval_s = interval_s
        self._last: MemoryReading | None = None
        self._at = 0.0

    def read(self) -> MemoryReading:
        """The latest reading, refreshed when older than the interval."""
        now = time.monotonic()
        if self._last is None or now - self._at >= self._interval_s:
            self._last = MemoryReading(self._process.memory_info().rss, self.device, self._device_bytes())
            self._at = now
        return self._last
