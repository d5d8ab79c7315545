"""`reqscope env`: every setting the engine runs under, its value, its default and where it came from.

As `vllm collect-env` and llama.cpp's system_info do, for a bug report or to see why a run took
the path it took: the machine (CPU and its flags, CUDA, threads), the C kernels and their
compiler, the arithmetic and kernel choices, the KV budget, the folders, the OpenMP policy, and
the Python and torch that run them (`minengine.settings`). No model is loaded; the C kernels are
built if this machine has not built them yet (a few seconds, once), since whether they build is
one of the answers.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Only the output's form."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print every setting, one a line (or one JSON object with --json)."""
    from minengine.record.settings_report import collect
    from reqscope.cli import version

    found = collect()
    if args.json:
        print(json.dumps({"reqscope": version().removeprefix("reqscope "), "settings": found.record()}))
    else:
        print(version())
        print("\n".join(found.lines()))
    return 0
