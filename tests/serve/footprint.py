"""The process's footprint, for the serving tests that check it stays flat under load: threads,
open file descriptors and resident memory, and the requests' worker threads still alive.

RSS is read after a garbage collection and after the C heap has given back what it only keeps
for reuse (`malloc_trim`, with glibc). Without the trim, the arenas of the many worker threads
that ran steps at once keep freed memory: 30 to 70 MiB after the first load past a warm-up, up
to 150 MiB without the warm-up, at random. Trimmed, a load of 200 requests grows RSS by about
10 MiB here (the telemetry log keeps every request's record, up to 1,000); a leak does not trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from minengine.engine.engine import Engine
from minengine.kv.arithmetic import MIB

# What "flat" allows, measured against a baseline taken after a warm-up at the same load.
THREAD_SLACK = 2
FD_SLACK = 8
RSS_SLACK = 64 * MIB

_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None  # glibc only


@dataclass(frozen=True)
class Resources:
    """The process's footprint: threads, open file descriptors, resident memory."""

    threads: int
    fds: int
    rss: int

    @classmethod
    def now(cls) -> Resources:
        """The footprint now, after a garbage collection and a trim of the C heap."""
        gc.collect()
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
        process = psutil.Process()
        return cls(process.num_threads(), process.num_fds(), process.memory_info().rss)

    def minus(self, before: Resources) -> Resources:
        """The growth since `before`."""
        return Resources(self.threads - before.threads, self.fds - before.fds, self.rss - before.rss)

    def within_slack_of(self, before: Resources) -> bool:
        """Flat: no more than the stated slack above `before`."""
        return self.settled_from(before) and self.rss - before.rss <= RSS_SLACK

    def settled_from(self, before: Resources) -> bool:
        """Threads and file descriptors (connections) no more than the stated slack above `before`."""
        return self.threads - before.threads <= THREAD_SLACK and self.fds - before.fds <= FD_SLACK

    def line(self) -> str:
        """A growth as the tests report it."""
        return f"threads {self.threads:+d}, fds {self.fds:+d}, RSS {self.rss / MIB:+.0f} MiB"


def workers(request_prefixes: Sequence[str]) -> list[str]:
    """The worker threads still alive of the requests whose IDs start with one of `request_prefixes`
    (the server runs each request on a thread named after it)."""
    names = tuple(f"reqscope-{prefix}" for prefix in request_prefixes)
    return [t.name for t in threading.enumerate() if t.name.startswith(names) and t.is_alive()]


def wait_until_idle(
    engine: Engine, request_prefixes: Sequence[str], settled_from: Resources | None = None, timeout_s: float = 30.0
) -> Resources:
    """Wait until nothing runs or waits, those requests' worker threads have ended and (given
    `settled_from`) the threads and file descriptors are back within the slack of it (the
    connections closed); the footprint then, whatever it is once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        scheduler = engine.scheduler
        idle = scheduler.running == 0 and scheduler.waiting == 0 and not workers(request_prefixes)
        now = Resources.now() if idle else None
        if now is not None and (settled_from is None or now.settled_from(settled_from)):
            return now
        if time.monotonic() > deadline:
            return now or Resources.now()
        time.sleep(0.05)
