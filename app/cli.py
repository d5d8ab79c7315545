"""`reqscope` command line: dispatches to subcommands, turns user errors into one-line messages.

`reqscope "PROMPT"` runs a request (the explorer UI on a terminal, text when `--plain` or when
stdout is not a terminal). Other verbs live in `reqscope.commands.<verb>`; each module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from minengine.errors import ReqscopeError
from minengine.omp_env import prefer_passive_wait

# verb -> (module, one-line help). The default verb (no name given) is "run".
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("reqscope.commands.run", "run one request (default when the first argument is a prompt)"),
    "pull": ("reqscope.commands.pull", "fetch and convert the default model (SmolLM2-135M-Instruct)"),
    "import": ("reqscope.commands.import_gguf", "convert a llama or qwen2 GGUF file into a model folder"),
    "metrics": ("reqscope.commands.metrics", "compute request metrics from a timeline CSV"),
    "plan": ("reqscope.commands.plan", "KV-memory and latency arithmetic for any model"),
    "replay": ("reqscope.commands.replay", "replay a recorded trace in the explorer, without a model"),
    "bench": ("reqscope.commands.bench", "benchmark minengine against Hugging Face transformers"),
    "serve": ("reqscope.commands.serve", "serve the model over an OpenAI-compatible HTTP API"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that exits with code 2 and one line, never a usage dump plus traceback."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse API
        self.exit(2, f"reqscope: error: {message} (see `{self.prog} --help`)\n")


def build_parser(verb: str) -> argparse.ArgumentParser:
    """The parser for one verb; `run` is also reachable as plain `reqscope PROMPT`."""
    module_name, help_text = SUBCOMMANDS[verb]
    prog = "reqscope" if verb == "run" else f"reqscope {verb}"
    parser = _Parser(prog=prog, description=help_text)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def _top_help() -> str:
    lines = ["usage: reqscope [run] PROMPT [options]", "       reqscope VERB [options]", "", "verbs:"]
    lines += [f"  {verb:<8} {help_text}" for verb, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "`reqscope VERB --help` for a verb's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `reqscope` console script."""
    prefer_passive_wait()  # before any verb's module imports torch
    try:
        return _main(argv)
    except KeyboardInterrupt:  # also while a verb's imports load (torch takes seconds)
        print("reqscope: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(_top_help())
        return 0
    verb = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    if argv and argv[0] == verb:
        argv = argv[1:]
    # Importing a verb (torch, for most) creates a few million objects that live as long as the
    # process; the collector's full passes over them cost about half a second of every start
    # (measured: first token 3.0 s -> 2.5 s). So: no collection while importing, then those
    # objects are frozen out of every later pass; collection itself stays on.
    gc.disable()
    try:
        parser = build_parser(verb)
    finally:
        gc.freeze()
        gc.enable()
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[verb][0])
    try:
        return int(module.run(args) or 0)
    except ReqscopeError as exc:
        print(f"reqscope: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """stdout's reader closed the pipe (`reqscope ... | head`): end quietly, as SIGPIPE would.

    Whatever is still buffered for stdout can never be delivered; pointing the descriptor at
    /dev/null lets the interpreter's final flush succeed instead of printing a second error.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


if __name__ == "__main__":
    sys.exit(main())
