"""The OpenMP wait policy, chosen before torch loads, and a look at what else the machine runs.

OpenMP reads its policy once, when torch loads its runtime, so it is set before `import torch`;
an explicit setting in the environment (OMP_WAIT_POLICY or GOMP_SPINCOUNT) always wins. The
choice is a trade (measured in docs/openmp-wait-policy.md):

- Spinning workers (OpenMP's default, or GOMP_SPINCOUNT) wake at once for the next parallel
  region, the fastest a decode step runs on 2 threads. But as soon as another process wants a
  core, a spinning worker holds one while the thread with work waits for its turn, region after
  region, and the step takes many times as long.
- Sleeping workers (PASSIVE) cost a wake-up per region, 121 regions a step, so a step takes
  about as long on 2 threads as on 1, idle or beside a busy process.

So the `reqscope` command that runs a request spins while it decodes and looks at the machine
as it goes (`fast.decode_threads`): on 2 threads while no other process wants the CPU, on one
thread (nothing left to spin for) as soon as one does. Other verbs, and platforms without
/proc/stat to look at, sleep (PASSIVE). What this process chose is recorded, so that a
benchmark can hand the environment the user had to a reference engine (`user_environment`), whose
speed reqscope's choice would change (docs/performance.md, "One stream: `reqscope bench`").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from minengine import settings  # imports no torch: the policy is still set before torch loads
from minengine.settings import SettingValue

VARIABLE = settings.OMP_WAIT_POLICY_ENV
SPIN_VARIABLE = settings.GOMP_SPINCOUNT_ENV
# About 0.3 ms of spinning by libgomp's own estimate: it bridges the gaps between a step's
# parallel regions as well as OpenMP's default of 300,000 does, and stops soon after the last one,
# so an idle process does not keep burning a core (docs/openmp-wait-policy.md, "The trade").
SPIN_COUNT = 30_000
# What this process sets when the environment says nothing (`choose_policy`), as settings list it.
_DEFAULT = f"PASSIVE, or {SPIN_VARIABLE}={SPIN_COUNT} while decoding"
_set_here = False  # OMP_WAIT_POLICY=PASSIVE chosen by this process
_spin_here = False  # GOMP_SPINCOUNT chosen by this process, to spin while decoding
_start: MachineSample | None = None


@dataclass(frozen=True)
class MachineSample:
    """CPU time spent on the machine and by this process, at one moment (seconds)."""

    wall: float  # time.monotonic()
    machine_busy: float  # all CPUs, every process, including time the hypervisor stole
    own: float  # this process, all its threads

    def others_since(self, earlier: MachineSample) -> float | None:
        """Cores other processes kept busy on average since `earlier` (None over too short a span)."""
        span = self.wall - earlier.wall
        if span <= 0:
            return None
        return max(0.0, (self.machine_busy - earlier.machine_busy) - (self.own - earlier.own)) / span


def sample_machine() -> MachineSample | None:
    """The machine's and this process's CPU time now, from /proc/stat (None where there is none)."""
    busy = settings.machine_busy_seconds()
    if busy is None:
        return None
    return MachineSample(time.monotonic(), busy, time.process_time())


def prefer_passive_wait() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment already says something."""
    global _set_here
    if not settings.omp_policy_given():
        settings.export(VARIABLE, "PASSIVE")
        _set_here = True


def choose_policy(*, decodes: bool) -> None:
    """The command's choice: spin while decoding for a verb that runs a request (`decodes`) where
    the machine can be watched, else `prefer_passive_wait`. The environment's own setting wins."""
    global _spin_here, _start
    if settings.omp_policy_given():
        return
    start = sample_machine() if decodes and (settings.cpu_count() or 1) > 1 else None
    if start is None:
        prefer_passive_wait()
        return
    settings.export(SPIN_VARIABLE, str(SPIN_COUNT))
    _spin_here, _start = True, start


def set_here() -> bool:
    """Whether this process, not its environment, chose the policy."""
    return _set_here or _spin_here


def spins_while_decoding() -> bool:
    """Whether this process chose to spin while decoding (and so must watch the machine)."""
    return _spin_here


def start_sample() -> MachineSample | None:
    """The machine sample taken when the policy was chosen (None unless this process spins)."""
    return _start


def user_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as the user had it: `environ` (default: this process's) without the policy
    this process set for itself. A setting the user made is kept."""
    env = settings.environment() if environ is None else dict(environ)
    if _set_here:
        env.pop(VARIABLE, None)
    if _spin_here:
        env.pop(SPIN_VARIABLE, None)
    return env


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The policy as `environ` (default: this process's) states it: `PASSIVE`, `not set`, or
    `not set, GOMP_SPINCOUNT=30000`."""
    env = settings.environment() if environ is None else environ
    text = env.get(VARIABLE) or "not set"
    if env.get(SPIN_VARIABLE):
        text += f", {SPIN_VARIABLE}={env[SPIN_VARIABLE]}"
    return text


def policy_setting() -> SettingValue:
    """The wait policy as a setting: the environment's, the one this process chose, or OpenMP's own."""
    value = describe()
    if _spin_here or _set_here:
        why = ("spin while decoding, one thread while other processes want a core" if _spin_here
               else "this process runs no request, so its workers sleep")  # fmt: skip
        return SettingValue("omp_wait_policy", value, _DEFAULT, settings.DEFAULT, f"chosen here: {why}")
    if settings.omp_policy_given():
        named = [name for name in (VARIABLE, SPIN_VARIABLE) if name in settings.environment()]
        return SettingValue("omp_wait_policy", value, _DEFAULT, settings.ENVIRONMENT, ", ".join(named))
    # Not the command (a library's process, a test): nothing chose, so the default is OpenMP's own.
    return SettingValue("omp_wait_policy", value, value, settings.DEFAULT, "OpenMP's own: its workers spin")
