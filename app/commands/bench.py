"""`reqscope bench`: minengine against Hugging Face transformers here; `reqscope bench serve`: load on a server.

The benchmark itself lives in `reqscope.bench.cli` (also runnable as `python -m reqscope.bench`);
this verb only exposes it. transformers, a dev dependency, is imported when the benchmark runs,
never by other verbs. The `serve` mode (`reqscope.bench.serve`) is an HTTP client, as
`vllm bench serve` is: parsing either mode's flags, and running `serve`, load no torch.
"""

from __future__ import annotations

import argparse

from reqscope.bench.cli import add_bench_arguments, run_from_args
from reqscope.bench.serve.cli import DESCRIPTION as SERVE_DESCRIPTION
from reqscope.bench.serve.cli import add_serve_arguments
from reqscope.bench.serve.cli import run as run_serve

SERVE_EXAMPLES = (
    "reqscope bench serve --num-prompts 16 --max-concurrency 4 --input-len 256 --output-len 64",
    "reqscope bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --json",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, device, rounds, launches and output flags; the `serve` mode with its own."""
    add_bench_arguments(parser)
    modes = parser.add_subparsers(dest="mode", title="modes", metavar="MODE")
    serve = modes.add_parser(
        "serve",
        help=SERVE_DESCRIPTION + "; `reqscope bench serve --help` for its flags",
        description=SERVE_DESCRIPTION,
        epilog="examples:\n" + "\n".join(f"  {line}" for line in SERVE_EXAMPLES),
        formatter_class=parser.formatter_class,
    )
    add_serve_arguments(serve)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (exit code 1 with `--check` when a target was not met), or the serve load."""
    if args.mode == "serve":
        return run_serve(args)
    return run_from_args(args)
