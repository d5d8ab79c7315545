"""`reqscope import MODEL.gguf OUT_DIR`: turn a llama or qwen2 GGUF into a model folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minengine.errors import ReqscopeError
from minengine.gguf.convert import DTYPES, convert_gguf
from reqscope.console.progress_line import ProgressLine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `reqscope import`."""
    parser.add_argument("gguf", type=Path, metavar="MODEL.gguf", help="llama or qwen2 GGUF file")
    parser.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR", help="new folder to create (must not exist yet)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weight dtype in the folder (default: float32 up to 1B parameters, else bfloat16)",
    )


def run(args: argparse.Namespace) -> int:
    """Convert, then print the new folder's path on stdout."""
    line = ProgressLine()
    try:
        folder = convert_gguf(args.gguf, args.out_dir, progress=line, dtype=args.dtype)
    except OSError as exc:
        raise ReqscopeError(f"cannot write {args.out_dir}: {exc.strerror or exc}") from None
    finally:
        line.close()
    print(folder, file=sys.stdout)
    return 0
