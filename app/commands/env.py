"""`reqscope env`: every setting the engine runs under, its value, its default and where it came from.

As `vllm collect-env` and llama.cpp's system_info do, for a bug report or to see why a run took
the path it took: the machine (CPU and its flags, CUDA, threads), the C kernels and their
compiler, the arithmetic and kernel choices, the KV budget, the folders, the OpenMP policy, and
the Python and torch that run them (`minengine.settings`). Then every environment variable
reqscope reads (`settings.VARIABLES`), whether it is set and what it sets; a key's value is never
printed. No model is loaded; the C kernels are built if this machine has not built them yet (a
few seconds, once), since whether they build is one of the answers.
"""

from __future__ import annotations

import argparse
import json

from minengine.settings import variables_now


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Only the output's form."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print every setting, one a line, then every environment variable (or one JSON object with --json)."""
    from minengine.record.settings_report import collect
    from reqscope.cli import version

    found = collect()
    # A key's value is left out (None): whether it is set is all a bug report needs.
    variables = [(v, value is not None, None if v.secret else value) for v, value in variables_now()]
    if args.json:
        environment = {v.name: {"set": given, "value": shown, "sets": v.sets} for v, given, shown in variables}
        print(json.dumps({"reqscope": version().removeprefix("reqscope "), "settings": found.record(),
                          "environment": environment}))  # fmt: skip
        return 0
    print(version())
    print("\n".join(found.lines()))
    print("\nenvironment variables read:")
    width = max(len(v.name) for v, _, _ in variables)
    for v, given, shown in variables:
        said = "not set" if not given else "set" if shown is None else repr(shown)
        print(f"  {v.name:<{width}}  {said:<12}  {v.sets}")
    return 0
