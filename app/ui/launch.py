"""Entry points from the command line into the explorer: a live run, or a recorded trace."""

from __future__ import annotations

import argparse
from pathlib import Path

from minengine.request import GenerationRequest
from minengine.trace_io import read_trace
from reqscope.run_options import open_engine
from reqscope.ui.app import ExplorerApp


def launch_explorer(args: argparse.Namespace, request: GenerationRequest) -> int:
    """Open the explorer on `request`, loading the engine from the shared run flags."""
    app = ExplorerApp.live_run(lambda progress: open_engine(args, progress=progress), request)
    code = app.run()
    return _exit_code(app, code)


def launch_replay(trace: str | Path) -> int:
    """Open the explorer on a trace written by an export (no model needed)."""
    header, events = read_trace(trace)
    app = ExplorerApp.replaying(header, events, source_name=Path(trace).name)
    return app.run() or 0


def _exit_code(app: ExplorerApp, code: int | None) -> int:
    if app.load_error is not None:
        # The screen is gone: repeat the reason on the terminal, as the text modes would.
        print(f"reqscope: error: {app.load_error}")
        return 1
    return code or 0
