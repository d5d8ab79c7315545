"""`reqscope replay TRACE`: step through a recorded run in the explorer, without a model."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace to replay."""
    parser.add_argument(
        "trace", metavar="TRACE",
        help="a request-trace.jsonl written by --export DIR or by the explorer's export key (x)",
    )


def run(args: argparse.Namespace) -> int:
    """Open the trace in the explorer; an unreadable trace is a one-line error (exit code 1)."""
    from reqscope.ui.launch import launch_replay

    return launch_replay(args.trace)
