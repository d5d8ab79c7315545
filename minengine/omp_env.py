"""The OpenMP wait policy, chosen before torch loads.

With OpenMP's default policy, worker threads spin for a while (milliseconds) after each parallel
region. On a machine with as many cores as threads and anything else running, the spinning
workers take cores from the thread doing the work: single-token decode, made of hundreds of
short parallel regions, measured ten times slower here (1-2 tokens/s instead of 20). PASSIVE
workers sleep instead. OpenMP reads the variable once, when torch loads its runtime, so it must
be set before `import torch`; an explicit setting in the environment always wins.
"""

from __future__ import annotations

import os

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
