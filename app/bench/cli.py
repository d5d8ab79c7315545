"""`python -m reqscope.bench` (also `reqscope bench`): minengine against Hugging Face transformers.

First the fair comparison: `reqscope --json`, transformers' `generate()` and any installed peer
(llama.cpp), each in its own process with the environment its users have, timed from outside;
then the in-process measurements. Same model, token ids and settings for every engine,
alternated round by round; prints a table with PASS/FAIL lines for the issue's targets, or the
whole report as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from reqscope.bench import env as bench_env  # first: sets the OpenMP policy before torch loads

# isort: split
from minengine.dtype_names import WEIGHT_FORMATS
from minengine.errors import ReqscopeError
from reqscope.argtypes import positive_whole_number as count
from reqscope.argtypes import whole_number
from reqscope.bench.fair.peers import PEER_NAMES, PeerChoice, check_names
from reqscope.engine_flags import add_engine_arguments
from reqscope.flag_aliases import deprecated_alias
from reqscope.run_options import DEFAULT_PROMPT
from reqscope.wording import error_text

if TYPE_CHECKING:
    from reqscope.bench.schedule import BenchConfig


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    add_engine_arguments(parser, "model", "device", "dtype", "weights", "kernels")
    parser.add_argument("--threads", type=count, help="torch threads for both engines (default: torch's own)")
    parser.add_argument("--rounds", type=count, default=5, help="measured rounds")
    parser.add_argument(
        "--output-len", type=count, default=128, help="greedy tokens per decode run, as `vllm bench latency`'s flag"
    )
    deprecated_alias(parser, "--new-tokens", "--output-len")
    parser.add_argument("--long-input-len", type=count, default=1025, help="tokens of the long prefill prompt")
    deprecated_alias(parser, "--long-prompt-tokens", "--long-input-len")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the short chat prompt")
    parser.add_argument(
        "--launches",
        type=whole_number,
        default=3,
        help="warm `reqscope --plain` launches after the first, for start-up and memory (0 skips launching)",
    )
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, decode through the captured static step",
    )
    parser.add_argument(
        "--peer",
        action="append",
        metavar="NAME",
        help=f"add this peer engine ({', '.join(PEER_NAMES)}); an error if it cannot run "
        "(default: every installed peer, skipped with a line when it cannot)",
    )
    parser.add_argument("--no-peers", action="store_true", help="run no peer engine")
    parser.add_argument(
        "--peer-gguf", metavar="FILE", help="GGUF for llama.cpp (default: the default model's own, fetched once)"
    )
    parser.add_argument(
        "--under-load",
        action="store_true",
        help="run the fair comparison again beside one busy process (a spinning Python loop)",
    )
    parser.add_argument(
        "--formats",
        default="all",
        metavar="LIST",
        help="other weight formats to run, each as its own `reqscope --json --weights F` side: comma-separated "
        f"({', '.join(WEIGHT_FORMATS)}), all (default: every one this machine runs, the rest listed as skipped) "
        "or none",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--output", metavar="FILE", help="also write the JSON report to FILE")
    parser.add_argument("--check", action="store_true", help="exit with code 1 when a target is not met")


def config_from_args(args: argparse.Namespace, progress=None) -> BenchConfig:
    """A BenchConfig from parsed flags (the default model is pulled first when missing)."""
    # Imported here, not above: the flags are parsed (`reqscope bench --help`, `bench serve`)
    # without torch, which the runner loads.
    from reqscope.bench.schedule import BenchConfig

    names = None if not args.peer else tuple(dict.fromkeys(args.peer))
    if args.no_peers:
        if names:
            raise ReqscopeError("--peer and --no-peers contradict each other; give one")
        names = ()
    check_names(names)  # before the default model is pulled: a typo costs nothing
    formats = _formats(args.formats)
    peers = PeerChoice(names, Path(args.peer_gguf).expanduser() if args.peer_gguf else None)
    if args.model:
        model_dir = Path(args.model).expanduser()
    else:
        from minengine.hub.pull import ensure_default_model

        model_dir = ensure_default_model(progress=_stage_ends(progress) if progress else None)
    return BenchConfig(
        model_dir=model_dir,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        threads=args.threads,
        rounds=args.rounds,
        new_tokens=args.output_len,
        long_prompt_tokens=args.long_input_len,
        prompt=args.prompt,
        warm_launches=args.launches,
        cuda_graph=args.cuda_graph,
        kernels=args.kernels,
        omp_policy_set_by_bench=bench_env.SET_BY_BENCH,
        peers=peers,
        under_load=args.under_load,
        formats=formats,
    )


def _formats(value: str) -> tuple[str, ...]:
    """`--formats`: "all", "none" or comma-separated format names (an unknown one is a usage error)."""
    if value.strip() == "all":
        return ("all",)  # reqscope.bench.formats.EVERY_FORMAT (that module imports torch)
    if value.strip() == "none":
        return ()
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in WEIGHT_FORMATS]
    if unknown or not names:
        raise ReqscopeError(
            f"--formats got {', '.join(unknown) or 'nothing'}; give all, none or some of {', '.join(WEIGHT_FORMATS)}"
        )
    return names


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark and print it; 1 with `--check` when a target failed."""
    from minengine.threads import model_thread
    from reqscope.bench.report import dumps, format_table, targets
    from reqscope.bench.schedule import run_bench

    config = config_from_args(args, progress=_stderr)
    # On the thread the engine steps on: one OpenMP team for its loads and every run it times.
    report = model_thread().call(run_bench, config, _stderr)
    text = dumps(report)
    print(text if args.json else format_table(report), flush=True)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    if args.check and not all(t.passed for t in targets(report)):
        return 1
    return 0


def _stage_ends(progress):
    """A pull's progress as one message per finished stage (its steps would be hundreds of lines)."""

    def report(event) -> None:
        if event.finished:
            progress(f"{event.title}: {event.message}")

    return report


def _stderr(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m reqscope.bench`."""
    parser = argparse.ArgumentParser(prog="python -m reqscope.bench", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except ReqscopeError as exc:
        print(f"bench: error: {error_text(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
