"""Entry points from the command line into the explorer: a live run, or a recorded trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minengine.engine.metrics import RequestMetrics
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.plan.cards import Architecture
from minengine.progress import paced
from minengine.record.trace_io import read_trace
from reqscope.run_options import open_engine
from reqscope.ui.endpoint.view import EndpointView
from reqscope.ui.run.app import ExplorerApp
from reqscope.ui.run.view import RunView
from reqscope.wording import error_text


def launch_explorer(args: argparse.Namespace, request: GenerationRequest, **options) -> int:
    """Open the explorer on `request`, loading the engine from the shared run flags.

    When the screen closes, one line on stderr keeps the outcome of the last run. The exit
    code is 1 when the engine could not start or the last run failed, as in the text modes.
    `options` go to `ExplorerApp` (`start_paused=True` holds before the first token).
    `--service-model FILE` (a `reqscope calibrate` fit) is read first: a bad file is a one-line error.
    """
    if getattr(args, "service_model", None) and "service_model" not in options:
        from minengine.plan.service_model import ServiceModel

        try:
            options["service_model"] = ServiceModel.load(args.service_model)
        except ReqscopeError as exc:
            print(f"reqscope: error: {error_text(exc)}", file=sys.stderr)
            return 1
    # The loading screen is fed across threads, a round trip per event: a pull's hundreds of
    # steps reach it at most 20 times a second per stage (starts and ends always).
    app = ExplorerApp.live_run(lambda progress: open_engine(args, progress=paced(progress)), request, **options)
    code = app.run()
    if app.load_error is not None:
        print(f"reqscope: error: {app.load_error}", file=sys.stderr)
        return 1
    if app.request is not None:
        print(f"reqscope: {app.request.request_id} {outcome(app.view)}", file=sys.stderr)
    if app.last_export is not None:
        print(f"reqscope: exported to {app.last_export}", file=sys.stderr)
    if app.view.error is not None:
        return 1
    return code or 0


def launch_endpoint_explorer(args: argparse.Namespace, request: GenerationRequest, arch: Architecture | None) -> int:
    """Open the endpoint explorer on `request` against args.endpoint (`--endpoint URL`).

    As with the engine explorer, one line on stderr keeps the last request's outcome after
    the screen closes, and the exit code is 1 when the server could not be used or the last
    request failed.
    """
    from reqscope.endpoint.settings import RequestSettings
    from reqscope.endpoint.target import EndpointTarget
    from reqscope.ui.endpoint.app import EndpointApp

    app = EndpointApp(EndpointTarget.from_args(args), request, settings=RequestSettings.from_args(args), arch=arch)
    code = app.run()
    if app.load_error is not None:
        print(f"reqscope: error: {app.load_error}", file=sys.stderr)
        return 1
    result = app.view.result
    if result is not None:
        print(f"reqscope: {result.request_id or app.request.request_id} {endpoint_outcome(app.view)}", file=sys.stderr)
        if result.error:
            return 1
    return code or 0


def endpoint_outcome(view: EndpointView) -> str:
    """How the endpoint request on screen ended, with the client's headline figures."""
    result = view.result
    if result is None:
        return "cancelled" if view.cancelled else f"left while streaming ({len(view.chunks)} chunks)"
    if result.error:
        return f"failed: {result.error}"
    text = f"{result.finish_reason or 'done'}: {result.output_tokens} tokens in {result.chunks} chunks"
    return text + headline(result.metrics) + (" (client clock)" if result.metrics else "")


def launch_replay(trace: str | Path) -> int:
    """Open the explorer on a trace written by an export (no model needed)."""
    header, events = read_trace(trace)
    app = ExplorerApp.replaying(header, events, source_name=Path(trace).name)
    return app.run() or 0


def outcome(view: RunView) -> str:
    """How the run on screen ended, with its headline figures."""
    result = view.result
    if result is None:
        return f"left while running ({len(view.tokens)} tokens generated)"
    if result.error:
        return f"failed: {result.error}"
    return f"{result.finish_reason}: {result.usage.completion_tokens} tokens" + headline(result.metrics)


def headline(m: RequestMetrics | None) -> str:
    """", TTFT …, TPOT …, decode …, E2E …" for an outcome line; empty without metrics."""
    if m is None:
        return ""
    text = f", TTFT {m.ttft_ms:.1f} ms"
    if m.tpot_ms is not None and m.decode_output_tokens_per_second is not None:
        text += f", TPOT {m.tpot_ms:.2f} ms, decode {m.decode_output_tokens_per_second:.2f} tok/s"
    return text + f", E2E {m.e2e_ms:.1f} ms"
