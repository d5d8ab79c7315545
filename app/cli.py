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
from importlib import metadata

from minengine.errors import ReqscopeError
from minengine.omp_env import choose_policy
from reqscope.wording import error_text

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
    "web": ("reqscope.commands.web", "serve the explorer to a web browser (one live session per page)"),
    "calibrate": ("reqscope.commands.calibrate", "fit prefill and decode time lines to this engine on this device"),
    "env": ("reqscope.commands.env", "every setting, its value, its default and where it came from (no model)"),
}


# A few commands per verb that work as written, shown under its --help.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "run": (
        'reqscope "Show me wheelchair-accessible hotels in Kyoto"',
        'reqscope --plain --temperature 0 --max-tokens 64 "Explain a KV cache"',
        'reqscope --tools examples/search_hotels.json --tool-choice required "Show me accessible hotels in Kyoto"',
        'reqscope --plain --json-schema examples/hotel_schema.json --repetition-penalty 1.2 "Hotels in Kyoto"',
        'reqscope --json --kv-layout mha "Hello" > run.jsonl',
        'reqscope --base-url http://127.0.0.1:8000/v1 --plain "Hello"',
        'reqscope --background 3 --serve-port 8001 "Write a long story"',
    ),
    "pull": ("reqscope pull",),
    "import": ("reqscope import model.Q4_K_M.gguf ~/models/my-model",),
    "metrics": ("reqscope metrics request-timeline.csv --output-len 150",),
    "plan": ("reqscope plan --list-cards", "reqscope plan llama-3.1-8b --input-len 6000 --output-len 400"),
    "replay": ("reqscope replay reqscope-runs/<id>/request-trace.jsonl",),
    "bench": ("reqscope bench", "reqscope bench --rounds 3 --json --output bench.json"),
    "serve": ("reqscope serve", "reqscope serve --host 0.0.0.0 --port 8000 --api-key \"$KEY\""),
    "web": ("reqscope web", 'reqscope web --paused --temperature 0 "Explain a KV cache"'),
    "calibrate": ("reqscope calibrate", "reqscope calibrate --json --output service-model.json"),
    "env": ("reqscope env", "reqscope env --json"),
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default as `(default: X)`, the one way defaults are written.

    The formatter writes it from argparse's default; a help whose flag defaults to None (the value
    is decided later: the model's file, the device, the server) writes `(default: ...)` itself.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "(default:" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is None or action.default == []:
            return f"{text} (default: not set)".lstrip()
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)".lstrip()
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """argparse that exits with code 2 and one line, never a usage dump plus traceback."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse API
        self.exit(2, f"reqscope: error: {message} (see `{self.prog} --help`)\n")


def build_parser(verb: str) -> argparse.ArgumentParser:
    """The parser for one verb; `run` is also reachable as plain `reqscope PROMPT`."""
    module_name, help_text = SUBCOMMANDS[verb]
    prog = "reqscope" if verb == "run" else f"reqscope {verb}"
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES.get(verb, ()))
    parser = _Parser(prog=prog, description=help_text, epilog=epilog, formatter_class=_HelpFormatter)
    importlib.import_module(module_name).add_arguments(parser)
    for action in parser._actions:  # argparse prints no help line, so no default, for help=None
        if action.help is None and action.option_strings:
            action.help = f"one of {', '.join(map(str, action.choices))}" if action.choices else "see docs/guide.md"
    return parser


def _top_help() -> str:
    lines = ["usage: reqscope [run] PROMPT [options]", "       reqscope VERB [options]", "", "verbs:"]
    lines += [f"  {verb:<8} {help_text}" for verb, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "examples:"] + [f"  {EXAMPLES[verb][0]}" for verb in ("run", "plan", "serve")]
    lines += ["", "`reqscope VERB --help` for a verb's options; `reqscope --version` for the version."]
    return "\n".join(lines)


def version() -> str:
    """`reqscope X.Y.Z`, from the installed package's metadata (no torch import)."""
    try:
        return f"reqscope {metadata.version('reqscope')}"
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "reqscope (not installed)"


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether `a` becomes `b` by one insertion, deletion, substitution or swap of neighbours."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])  # fmt: skip
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def mistyped_verb(word: str) -> str | None:
    """The verb a first word misspells by one edit (`serv` -> `serve`), or None."""
    if not word or word.startswith("-") or not word.isalpha():
        return None
    matches = [verb for verb in SUBCOMMANDS if _one_edit_apart(word.lower(), verb)]
    return matches[0] if len(matches) == 1 else None


SPINNING_VERBS = ("run", "calibrate", "serve")


def decodes_requests(argv: list[str]) -> bool:
    """Whether this command line decodes in this process, so that OpenMP's workers may spin.

    A request's decode spins (watching the machine): the explorer, `--plain`, `--json`, each
    browser tab's explorer (`web --session`, a process of its own), and `serve`, whose requests'
    steps all run on the process's model thread. So does calibrate, whose fit must describe the
    steps `run` takes. Every other verb sleeps.
    """
    if argv[:1] == ["web"]:
        return "--session" in argv
    return not argv or argv[0] in SPINNING_VERBS or argv[0] not in SUBCOMMANDS


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `reqscope` console script."""
    # Before any verb's module imports torch (minengine.omp_env).
    choose_policy(decodes=decodes_requests(sys.argv[1:] if argv is None else argv))
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
    if argv and argv[0] in ("-V", "--version"):
        print(version())
        return 0
    if argv and (meant := mistyped_verb(argv[0])) is not None:
        # A one-word typo of a verb would otherwise run a whole request on it as the prompt.
        print(
            f"reqscope: error: did you mean `reqscope {meant}`? (use `reqscope run {argv[0]}` to send it as a prompt)",
            file=sys.stderr,
        )
        return 2
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
        print(f"reqscope: error: {error_text(exc)}", file=sys.stderr)
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
