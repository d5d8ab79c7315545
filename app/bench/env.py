"""Process settings the benchmark makes before torch loads (import this module first).

The OpenMP wait policy (see `omp_env`): both engines run in the benchmark's process, so both get
the same policy. The `reqscope --plain` launches get the user's environment, not the setting made
here; the command chooses its own policy the same way.
"""

from __future__ import annotations

from minengine.omp_env import prefer_passive_wait, set_here

prefer_passive_wait()
SET_BY_BENCH = set_here()
