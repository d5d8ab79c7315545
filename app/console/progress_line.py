"""Show pull/convert progress on stderr: one line rewritten in place on a terminal, one
summary line per finished stage otherwise (so logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from minengine.progress import PullProgress

_REFRESH_S = 0.1


class ProgressLine:
    """A progress callback for `pull_default_model` / `convert_gguf`; call `close()` at the end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._live = self._stream.isatty()
        self._last: PullProgress | None = None
        self._last_draw = 0.0
        self._width = 0

    def __call__(self, event: PullProgress) -> None:
        previous, self._last = self._last, event
        new_stage = previous is None or previous.stage != event.stage
        if not self._live:
            if new_stage and previous is not None:
                print(render(previous), file=self._stream, flush=True)
            return
        now = time.monotonic()
        finished = event.total is not None and event.done >= event.total
        if new_stage or finished or now - self._last_draw >= _REFRESH_S:
            self._draw(render(event))
            self._last_draw = now

    def close(self) -> None:
        """Finish the output: end the live line, or report the last stage."""
        if self._live and self._width:
            self._stream.write("\n")
            self._stream.flush()
        elif not self._live and self._last is not None:
            print(render(self._last), file=self._stream, flush=True)
        self._last, self._width = None, 0

    def _draw(self, text: str) -> None:
        padding = " " * max(0, self._width - len(text))
        self._stream.write(f"\r{text}{padding}")
        self._stream.flush()
        self._width = len(text)


def render(event: PullProgress) -> str:
    """One status line, e.g. `verify    42%  sha256 of model.gguf`."""
    fraction = event.fraction
    amount = f"{fraction:4.0%}" if fraction is not None else "    "
    return f"{event.stage:<9}{amount}  {event.message}"
