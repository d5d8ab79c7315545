"""How many CPU threads a model step runs on, looked at again as the machine changes (`StepThreads`).

When the `reqscope` command runs a request it lets OpenMP's workers spin (`omp_env`): the
121 parallel regions of a decode step then start at once, and a step on both cores of a 2-core
machine took about half as long as with sleeping workers. Spinning only pays while nobody else
wants the cores: beside one busy process the spinning worker holds a core while the thread with
work waits for one, and a step took ten times as long or more, where on a single thread there is
nothing to wait for (docs/openmp-wait-policy.md, "The trade", has the figures).

So every step first asks how much CPU other processes used lately (/proc/stat, less this
process's own time, over at least `WINDOW_S`): under `BUSY_CORES` of a core, all threads; more,
one thread. A step on all threads that still comes out far slower than the best seen (this
process's own threads can compete too, which /proc/stat cannot tell apart) also drops to one
thread, for a while that doubles each time it happens; it takes `SLOW_RUN` such steps in a row,
because a lone slow step is the explorer drawing a frame (a few milliseconds of its UI thread,
paced), not a core gone, and backing off on every one of them slowed the explorer down
(docs/openmp-wait-policy.md, "What `reqscope` does"). Every output is computed by the same
kernels in the same order whatever the count (chunked projections run their chunks one after
the other on one thread), so the choice never changes a value.

Only a process that chose to spin (`omp_env.spins_while_decoding`) is steered; anywhere else the
thread count is left as it is.
"""

from __future__ import annotations

import threading
import time

import torch

from minengine import omp_env

WINDOW_S = 0.2  # /proc/stat counts in 10 ms ticks: 0.2 s of 2 CPUs is 40 of them
# Others' use above this (in cores) means a core is wanted elsewhere. A busy neighbour is a whole
# core, while an idle 2-vCPU VM shows up to a third of one (kernel threads, steal), which a
# threshold of 0.3 took for a neighbour (docs/history.md, "`reqscope bench`: every format beside
# transformers and llama.cpp, fp16 as `auto`").
BUSY_CORES = 0.5
SLOW_FACTOR = 2.5  # a step this much slower than the best at full threads was not on free cores
SLOW_FLOOR_S = 0.005  # ...and at least this much slower (short steps jitter by more than 2.5x)
SLOW_RUN = 3  # slow steps in a row before backing off (one alone is a passing burst)
BACKOFF_STEPS = 32  # steps on one thread after the first such step; doubles up to MAX_BACKOFF_STEPS
MAX_BACKOFF_STEPS = 1024


class StepThreads:
    """Chooses the thread count of each model step and restores the count after it.

    Use as `with step_threads.step() as timed: ...`; `timed` is False for steps whose time
    says nothing about decode (several tokens at once), which are only steered.
    """

    def __init__(self, threads: int, *, steer: bool | None = None) -> None:
        self.threads = threads
        self.steer = (omp_env.spins_while_decoding() if steer is None else steer) and threads > 1
        self._lock = threading.Lock()
        self._last = omp_env.start_sample() if self.steer else None
        self._busy = False  # other processes want a core
        self._best_s = float("inf")  # fastest single-token step at full threads
        self._backoff = 0  # steps left on one thread after a slow step
        self._next_backoff = BACKOFF_STEPS
        self._slow_in_a_row = 0
        self.last_count = threads

    def count(self) -> int:
        """Threads for the next step (looks at the machine at most every WINDOW_S)."""
        if not self.steer:
            return self.threads
        with self._lock:
            # /proc/stat is read only once a window has passed: every step read it, 20-60 us each.
            due = self._last is None or time.monotonic() - self._last.wall >= WINDOW_S
            now = omp_env.sample_machine() if due else None
            if now is not None and (self._last is None or now.wall - self._last.wall >= WINDOW_S):
                others = now.others_since(self._last) if self._last is not None else None
                if others is not None:
                    self._busy = others > BUSY_CORES
                self._last = now
            if self._backoff > 0:
                self._backoff -= 1
                return 1
            return 1 if self._busy else self.threads

    def record(self, count: int, seconds: float) -> None:
        """A single-token step on `count` threads took `seconds`."""
        if not self.steer or count != self.threads:
            return
        with self._lock:
            self._best_s = min(self._best_s, seconds)
            if seconds <= SLOW_FACTOR * self._best_s or seconds - self._best_s <= SLOW_FLOOR_S:
                self._slow_in_a_row = 0
                return
            self._slow_in_a_row += 1
            if self._slow_in_a_row >= SLOW_RUN:
                self._slow_in_a_row = 0
                self._backoff = self._next_backoff
                self._next_backoff = min(2 * self._next_backoff, MAX_BACKOFF_STEPS)

    def step(self, single_token: bool) -> _Step:
        """A context for one step: sets the count on entry, restores it (and records) on exit."""
        return _Step(self, single_token)


class _Step:
    __slots__ = ("owner", "single", "count", "start")

    def __init__(self, owner: StepThreads, single: bool) -> None:
        self.owner, self.single = owner, single

    def __enter__(self) -> None:
        owner = self.owner
        self.count = owner.count()
        owner.last_count = self.count
        if self.count != owner.threads:
            torch.set_num_threads(self.count)
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        owner = self.owner
        elapsed = time.perf_counter() - self.start
        if self.count != owner.threads:
            torch.set_num_threads(owner.threads)
        if self.single and exc[0] is None:
            owner.record(self.count, elapsed)
