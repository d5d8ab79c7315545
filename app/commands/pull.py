"""`reqscope pull`: fetch and convert the default model, then print its folder."""

from __future__ import annotations

import argparse
import sys
import time

from minengine.hub.pull import default_model_dir, is_model_dir, pull_default_model
from reqscope.console.progress_line import ProgressLine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `reqscope pull`."""
    parser.add_argument(
        "--force", action="store_true", help="download and convert again even if the model is there"
    )


def run(args: argparse.Namespace) -> int:
    """Pull the default model; the folder path goes to stdout, progress to stderr."""
    if is_model_dir(default_model_dir()) and not args.force:
        print("default model already present (use --force to fetch it again)", file=sys.stderr)
        print(default_model_dir())
        return 0
    started = time.monotonic()
    line = ProgressLine()
    try:
        folder = pull_default_model(progress=line, force=args.force)
    finally:
        line.close()
    print(f"done in {time.monotonic() - started:.1f} s", file=sys.stderr)
    print(folder)
    return 0
