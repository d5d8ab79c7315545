"""`reqscope replay TRACE`: step through a recorded run in the explorer, without a model."""

from __future__ import annotations

import argparse

from minengine.errors import ReqscopeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace to replay."""
    parser.add_argument(
        "trace", metavar="TRACE",
        help="a request-trace.jsonl written by --export DIR or the explorer's export key (x)",
    )


def run(args: argparse.Namespace) -> int:
    """Open the trace in the explorer (read errors are one line, exit code 1)."""
    from minengine.trace_io import read_trace

    read_trace(args.trace)  # fail on the terminal, before the screen takes it over
    from reqscope.ui.launch import launch_replay

    try:
        return launch_replay(args.trace)
    except ReqscopeError:
        raise
