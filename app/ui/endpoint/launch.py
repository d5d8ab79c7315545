"""Entry point from the command line into the endpoint explorer (`--base-url URL` on a terminal)."""

from __future__ import annotations

import argparse
import sys

from minengine.engine.request import GenerationRequest
from minengine.plan.cards import Architecture
from reqscope.endpoint.options import controls_from
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.ui.endpoint.app import EndpointApp
from reqscope.ui.outcome import endpoint_outcome


def launch_endpoint_explorer(args: argparse.Namespace, request: GenerationRequest, arch: Architecture | None) -> int:
    """Open the endpoint explorer on `request` against args.base_url (`--base-url URL`).

    As with the engine explorer, one line on stderr keeps the last request's outcome after
    the screen closes, and the exit code is 1 when the server could not be used or the last
    request failed.
    """
    app = EndpointApp(EndpointTarget.from_args(args), request, settings=RequestSettings.from_args(args), arch=arch,
                      controls=controls_from(args, request))
    code = app.run()
    if app.load_error is not None:
        print(f"reqscope: error: {app.load_error}", file=sys.stderr)
        return 1
    result = app.view.result
    if result is not None:
        print(f"reqscope: {app.request.request_id} {endpoint_outcome(app.view)}", file=sys.stderr)
        if result.error:
            return 1
    return code or 0
