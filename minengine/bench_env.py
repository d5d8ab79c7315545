"""Process settings the benchmark makes before torch loads (import this module first).

With OpenMP's default wait policy, worker threads spin for a while after each parallel region.
On a machine with as many cores as threads and anything else running, the spinning workers
take cores from the thread doing the work: single-token decode, made of hundreds of short
parallel regions, measured ten times slower here. PASSIVE workers sleep instead. OpenMP reads
the variable once, when torch loads its runtime, so it must be set before `import torch`;
an explicit setting in the environment wins. Both engines run in the benchmark's process, so
both get the same policy; the `reqscope --plain` launches run with the user's environment.
"""

from __future__ import annotations

import os

SET_BY_BENCH = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
