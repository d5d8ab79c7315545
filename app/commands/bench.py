"""`reqscope bench`: minengine against Hugging Face transformers on this machine.

The benchmark itself lives in `reqscope.bench.cli` (also runnable as `python -m reqscope.bench`);
this verb only exposes it. transformers, a dev dependency, is imported when the benchmark runs,
never by other verbs.
"""

from __future__ import annotations

import argparse

from reqscope.bench.cli import add_bench_arguments, run_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, device, rounds, launches and output flags."""
    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; exit code 1 with `--check` when a target was not met."""
    return run_from_args(args)
