"""How much of the CPU other processes took while a ceiling was measured.

A ceiling is the fastest the machine goes, and every fraction shown against it divides by it.
Measured while other processes use the cores, it comes out low, and the fractions come out high
(docs/lab/engine-costs.md has a run of each). `reqscope calibrate` therefore measures, beside each probe,
the CPU that everything but this process used over the same seconds (the hypervisor's steal
included), and says so when it was more than a quarter of a core.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

# Other processes' mean use, in cores, from which a measurement is called disturbed: daemons and a
# terminal stay well below it, a test run or a build beside the probe well above.
BUSY_CORES = 0.25
# Fields of psutil.cpu_times() that are not time spent working: `guest` and `guest_nice` are already
# counted in `user` and `nice` on Linux.
_NOT_BUSY = ("idle", "iowait", "guest", "guest_nice")
OTHER_LOAD_MARK = "other processes used"  # how a kept probe says it was disturbed


@dataclass(frozen=True)
class OtherLoad:
    """What the rest of the machine used over one span."""

    cores: float  # the mean CPU of every other process (and steal) over the span, in cores
    span_s: float
    machine_cores: int

    @property
    def disturbed(self) -> bool:
        """Whether other work used enough of the CPU to pull the measurement down."""
        return self.cores > BUSY_CORES

    def describe(self) -> str:
        """E.g. "other processes used 1.6 of 2 cores meanwhile"."""
        return f"{OTHER_LOAD_MARK} {self.cores:.1f} of {self.machine_cores} cores meanwhile"


class OtherLoadMeter:
    """`with OtherLoadMeter() as meter: ...`, then `meter.load`: what the others used over the block."""

    def __enter__(self) -> OtherLoadMeter:
        import psutil  # here, not at the top: every run reads the ceilings' file, and the plain path skips psutil

        self._own = psutil.Process()
        self._start = (time.monotonic(), _busy_s(), _own_s(self._own))
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, own = self._start
        span = max(time.monotonic() - wall, 1e-9)
        others = max(_busy_s() - busy - (_own_s(self._own) - own), 0.0)
        self.load = OtherLoad(cores=others / span, span_s=span, machine_cores=os.cpu_count() or 1)


def _busy_s() -> float:
    import psutil

    times = psutil.cpu_times()._asdict()
    return sum(value for name, value in times.items() if name not in _NOT_BUSY)


def _own_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system
