"""Entry points from the command line into the explorer: a live run, or a recorded trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.progress import paced
from minengine.record.trace_io import read_trace
from reqscope.endpoint.trace import is_endpoint_trace, read_endpoint_trace
from reqscope.run_options import ModelFolder, open_engine
from reqscope.ui.outcome import outcome
from reqscope.ui.run.live_app import LiveExplorer
from reqscope.ui.run.replay_app import ReplayExplorer
from reqscope.wording import error_text


def launch_explorer(args: argparse.Namespace, request: GenerationRequest, model: ModelFolder, **options) -> int:
    """Open the explorer on `request`, loading `model` with the shared run flags.

    When the screen closes, one line on stderr keeps the outcome of the last run. The exit
    code is 1 when the engine could not start or the last run failed, as in the text modes.
    `options` go to `LiveExplorer` (`start_paused=True` holds before the first token, `load` puts
    background requests and the served API on its engine).
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
    app = LiveExplorer(lambda progress: open_engine(args, model, progress=paced(progress)), request, **options)
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


def launch_replay(trace: str | Path) -> int:
    """Open the explorer on a trace written by an export (no model needed): the engine explorer's,
    or the endpoint explorer's for a request sent to a server."""
    if is_endpoint_trace(trace):
        from reqscope.ui.endpoint.app import EndpointApp

        endpoint_header, recorded = read_endpoint_trace(trace)
        return EndpointApp.replaying(endpoint_header, recorded).run() or 0
    header, events = read_trace(trace)
    app = ReplayExplorer(header, events, source_name=Path(trace).name)
    return app.run() or 0
