"""The OpenMP wait policy, chosen before torch loads.

With OpenMP's default policy, worker threads spin for a while (milliseconds) after each parallel
region. On a machine with as many cores as threads and anything else running, the spinning
workers take cores from the thread doing the work: single-token decode, made of hundreds of
short parallel regions, measured ten times slower here (1-2 tokens/s instead of 20). PASSIVE
workers sleep instead. OpenMP reads the variable once, when torch loads its runtime, so it must
be set before `import torch`; an explicit setting in the environment always wins.

What the process chose for itself is recorded, so that a benchmark can hand the environment the
user had to a reference engine (`user_environment`): measuring transformers under a policy
chosen for reqscope slowed it from 25 to 16-17 tokens/s here, which is not how its users run it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

VARIABLE = "OMP_WAIT_POLICY"
_set_here = False


def prefer_passive_wait() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment already says something."""
    global _set_here
    if VARIABLE not in os.environ:
        os.environ[VARIABLE] = "PASSIVE"
        _set_here = True


def set_here() -> bool:
    """Whether this process, not its environment, chose the policy."""
    return _set_here


def user_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as the user had it: `environ` (default: this process's) without the policy
    this process set for itself. A setting the user made is kept."""
    env = dict(os.environ if environ is None else environ)
    if _set_here:
        env.pop(VARIABLE, None)
    return env


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The policy as `environ` (default: this process's) states it, e.g. `PASSIVE` or `not set`."""
    value = (os.environ if environ is None else environ).get(VARIABLE)
    return value if value else "not set"
