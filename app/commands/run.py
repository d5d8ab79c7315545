"""`reqscope [run] PROMPT`: the explorer UI on a terminal, text or JSON lines otherwise."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Iterator

from minengine.engine.events import Event
from minengine.inspect.ask import InspectAsk
from reqscope.endpoint.options import add_endpoint_arguments
from reqscope.engine_load import EngineLoad, LoadOptions, add_load_arguments
from reqscope.run_options import (
    DEFAULT_PROMPT,
    ModelFolder,
    add_run_arguments,
    open_engine,
    request_from_args,
    stderr_progress,
)
from reqscope.wording import in_app_words


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt, the output mode and the shared run flags."""
    parser.add_argument("prompt", nargs="?", default=None, help=f"the user message (default: {DEFAULT_PROMPT!r})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plain", action="store_true", help="stream text and a timing summary (no UI)")
    mode.add_argument("--json", action="store_true", help="one JSON object per line per event (no UI)")
    parser.add_argument(
        "--export", metavar="DIR", help="write timeline CSV, metrics JSON, token trace and a Perfetto trace to DIR"
    )
    parser.add_argument(
        "--force", action="store_true", help="with --export: replace the export files of an earlier run in DIR"
    )
    inside = parser.add_argument_group("inside the step (headless; each token record and the export keep them)")
    inside.add_argument(
        "--attention", type=int, default=0, metavar="TOP_N",
        help="record each step's attention: per layer and head the TOP_N most-attended positions and the entropy",
    )  # fmt: skip
    # Two flags rather than `--lens [BASIS]`: an optional value would take the prompt after it.
    inside.add_argument(
        "--lens", action="store_const", const="candidates", default=None,
        help="record each step's logit lens: each layer's top token and the chosen token's rank, over the "
        "step's 20 most likely tokens",
    )  # fmt: skip
    inside.add_argument(
        "--lens-vocab", dest="lens", action="store_const", const="vocab",
        help="the logit lens over the whole vocabulary (slower)",
    )
    add_run_arguments(parser)
    add_load_arguments(parser)
    add_endpoint_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run one request in the chosen mode; exit code 1 when the request failed."""
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    load = LoadOptions.of(args)  # before the model loads: a taken port wastes no load
    if args.base_url and load.any:
        print("reqscope: error: --background and --serve-port load this process's engine; with --base-url "
              "the server is elsewhere (drive it with `reqscope bench serve --base-url`)", file=sys.stderr)
        return 2
    if args.base_url and args.chat_template:
        print("reqscope: error: --chat-template replaces this process's template; with --base-url the server "
              "renders the prompt (start it with its own --chat-template)", file=sys.stderr)
        return 2
    if args.base_url:  # --model names the served model, not a folder
        from reqscope.endpoint.run import run_endpoint

        return run_endpoint(args, request_from_args(args, prompt, None))
    model = ModelFolder.of(args)
    request = request_from_args(args, prompt, model)
    inspect_ask = InspectAsk(attention_top=max(args.attention, 0), lens=args.lens)
    if args.attention < 0:
        print(f"reqscope: error: --attention {args.attention}: give the top positions to keep, 1 or more "
              "(0 records none)", file=sys.stderr)
        return 2
    headless = args.plain or args.json or not sys.stdout.isatty()
    if not headless:
        if args.export:  # the explorer exports on `x`, each run to a new folder; never drop the flag silently
            print("reqscope: error: --export works with --plain or --json; in the explorer press x", file=sys.stderr)
            return 2
        from reqscope.ui.launch import launch_explorer

        return launch_explorer(args, request, model, load=load)
    if args.export:
        from minengine.record.export import prepare_export_folder

        prepare_export_folder(args.export, force=args.force)  # before the run: a bad path wastes none
    engine = open_engine(args, model, progress=None if args.json else stderr_progress)
    from minengine.record.settings_report import collect_for_engine
    from reqscope.bench.ceiling import stored_ceiling

    ceiling = stored_ceiling(engine.device)  # this machine's read ceiling, for the roofline
    given_by = None if args.kv_budget_mib is None else "--kv-budget-mib"
    settings = collect_for_engine(engine, kv_budget_given_by=given_by)  # for --json and the trace's header
    recorded: list = []
    with EngineLoad(engine, load, request) as beside:
        note = beside.note if load.any else None
        session = engine.start(request)
        session.inspect(inspect_ask)
        events = _recording(in_app_words(session), recorded, beside.follow)
        if args.json:
            from reqscope.console.jsonl import print_jsonl
            from reqscope.console.roofline_lines import prefill_facts

            result = print_jsonl(events, request=request, ceiling=ceiling, weights=engine.weights, load=note,
                                 settings=settings, prefill=prefill_facts(engine))  # fmt: skip
        else:
            from reqscope.console.plain import print_plain
            from reqscope.console.roofline_lines import prefill_facts

            result = print_plain(engine, events, request=request, ceiling=ceiling, load=note,
                                 prefill=prefill_facts(engine))  # fmt: skip
    if args.export:
        from minengine.record.export import export_run
        from minengine.record.trace_io import trace_header
        from reqscope.console.roofline_lines import prefill_facts

        header = trace_header(engine, ceiling.ceiling, settings, prefill_facts(engine).compute)
        written = export_run(result, args.export, recorded, header)
        print(f"reqscope: exported {len(written)} files to {args.export}", file=sys.stderr)
    if result.error:
        print(f"reqscope: error: {result.error}", file=sys.stderr)
        return 1
    return 0


def _recording(events: Iterable[Event], into: list, follow: Callable[[Event], None]) -> Iterator[Event]:
    for event in events:
        into.append(event)
        follow(event)
        yield event
