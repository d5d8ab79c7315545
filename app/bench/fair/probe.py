"""What the `reqscope` command runs with, found by doing what it does before torch loads.

    python -m reqscope.bench.fair.probe

Launched with the environment the benchmark launches `reqscope --json` with, it makes the
command's own OpenMP choice for a verb that runs a request (`omp_env.choose_policy`, the first
thing `reqscope.cli.main` calls), loads torch, and writes one `environment` event (see `pipes`):
the policy, torch's thread count, the torch version. `reqscope --json` itself writes no such line.
"""

from __future__ import annotations

import sys

from minengine import omp_env
from reqscope.bench.fair.pipes import ChildEnvironment


def main() -> int:
    """Write the environment event."""
    omp_env.choose_policy(decodes=True)
    policy = omp_env.describe()
    if omp_env.spins_while_decoding():
        policy += " (reqscope's default: spins while decoding, 1 thread while other processes want a core)"
    elif omp_env.set_here():
        policy += " (reqscope's default)"
    import torch

    ChildEnvironment(policy, torch.get_num_threads(), f"torch {torch.__version__}").write(sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
