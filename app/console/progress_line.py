"""Show pull, convert and first-load progress on stderr.

On a terminal each stage is one line, redrawn in place (carriage return) at most ten times a
second: a bar, the amount done, the rate and the ETA. Anywhere else (a log file, a pipe, CI) a
stage writes at most two lines, one when it starts and one when it ends, so a log stays
readable however many steps the source reports.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from minengine.progress import BYTES, PullProgress
from minengine.settings import COLUMNS_ENV, read_env

_REFRESH_S = 0.1
_BAR_CELLS = 20


class ProgressLine:
    """A progress callback for `pull_default_model`, `convert_gguf` and `Engine` loading.

    It takes stage events and plain messages (a message ends the stage line on screen, then
    prints as its own line). `stream` is looked up at every write when not given, so one
    instance can serve a whole process. Call `close()` when done, so an unfinished stage's line
    is ended before anything else is printed.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        prefix: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._given = stream
        self.prefix = prefix
        self._clock = clock
        self._phase: tuple[str, float | None] | None = None  # the stage whose start was shown
        self._open = 0  # width of a live line drawn without its newline yet, 0 when none
        self._last_draw = float("-inf")

    @property
    def stream(self) -> TextIO:
        """Where the lines go."""
        return self._given or sys.stderr

    def __call__(self, item: PullProgress | str) -> None:
        if isinstance(item, str):
            self.message(item)
            return
        stream = self.stream
        phase = (item.stage, item.started)
        new_phase = phase != self._phase
        self._phase = phase
        now = self._clock()
        if not _is_terminal(stream):
            if new_phase:
                self._print(stream, started_line(item))
            if item.finished:
                self._print(stream, finished_line(item, now))
            return
        if item.finished:
            self._draw(stream, live_line(item, now, _columns(stream), _bars_for(stream)), end=True)
        elif new_phase or now - self._last_draw >= _REFRESH_S:
            self._draw(stream, live_line(item, now, _columns(stream), _bars_for(stream)), end=False)
            self._last_draw = now

    def message(self, text: str) -> None:
        """One line of its own (after ending any stage line on screen)."""
        self.close()
        self._print(self.stream, text)

    def close(self) -> None:
        """End a stage line left open on a terminal (a stage that stopped without finishing)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = 0
        self._phase = None

    def _print(self, stream: TextIO, text: str) -> None:
        stream.write(f"{self.prefix}{text}\n")
        stream.flush()

    def _draw(self, stream: TextIO, text: str, *, end: bool) -> None:
        text = self.prefix + text
        padding = " " * max(0, self._open - len(text))  # cover what a longer previous draw left
        stream.write(f"\r{text}{padding}" + ("\n" if end else ""))
        stream.flush()
        self._open = 0 if end else len(text)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: treat it as a log
        return False


def _columns(stream: TextIO) -> int:
    """The width of the terminal `stream` writes to (stdout may be redirected while stderr is not)."""
    try:
        return int(read_env(COLUMNS_ENV) or "")
    except ValueError:  # unset, or not a number
        pass
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no descriptor, or not a terminal after all
        return 100


def _bars_for(stream: TextIO) -> tuple[str, str]:
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
    return ("█", "░") if encoding.startswith("utf") else ("#", "-")


# -- text ----------------------------------------------------------------------------------------


def amount(value: float, unit: str) -> str:
    """A count in its unit: bytes in MB (as pip prints sizes), anything else as a plain count."""
    if unit == BYTES:
        if value >= 1e9:
            return f"{value / 1e9:.2f} GB"
        return f"{value / 1e6:.1f} MB"
    return f"{int(value)} {unit}"


def progress_amount(event: PullProgress) -> str:
    """Done out of total ("42.1/93.4 MB", "12/272 tensors"), or just what is done while the total is unknown."""
    if event.total is None:
        return amount(event.done, event.unit)
    if event.unit == BYTES:
        return f"{event.done / 1e6:.1f}/{amount(event.total, BYTES)}"
    return f"{event.done}/{amount(event.total, event.unit)}"


def rate_text(event: PullProgress, now: float | None = None) -> str:
    """The rate ("15.3 MB/s", "340 tensors/s"), or "" while no rate is known."""
    rate = event.rate(now)
    if rate is None:
        return ""
    if event.unit == BYTES:
        return f"{rate / 1e6:.1f} MB/s"
    return f"{rate:.0f} {event.unit}/s" if rate >= 10 else f"{rate:.2g} {event.unit}/s"  # not "0 requests/s"


def duration(seconds: float) -> str:
    """Seconds as "0.4 s", "12 s" or "1:05"."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


def eta_text(event: PullProgress, now: float | None = None) -> str:
    """Time left ("ETA 3.2 s"), or "" while it cannot be told."""
    eta = event.eta(now)
    return "" if eta is None else f"ETA {duration(eta)}"


def bar(fraction: float | None, cells: int = _BAR_CELLS, glyphs: tuple[str, str] = ("#", "-")) -> str:
    """A text bar `cells` wide; all empty while the fraction is unknown."""
    full, empty = glyphs
    filled = 0 if fraction is None else round(max(0.0, min(1.0, fraction)) * cells)
    return full * filled + empty * (cells - filled)


def live_line(
    event: PullProgress, now: float | None = None, columns: int = 100, glyphs: tuple[str, str] = ("#", "-")
) -> str:
    """The line redrawn in place, cut to the terminal's width (a wrapped line cannot be redrawn)."""
    if event.finished:
        return finished_line(event, now)[: max(10, columns - 1)]
    fraction = event.fraction
    percent = f"{fraction:4.0%}" if fraction is not None else "    "
    parts = [f"{event.title:<18}", f"[{bar(fraction, glyphs=glyphs)}]", percent, progress_amount(event)]
    parts += [text for text in (rate_text(event, now), eta_text(event, now)) if text]
    parts.append(event.message)
    return "  ".join(parts)[: max(10, columns - 1)]


def started_line(event: PullProgress) -> str:
    """The line a log gets when a stage starts: what it is and how much there is to do."""
    size = f"  {amount(event.total, event.unit)}" if event.total else ""
    return f"{event.title} ...{size}  {event.message}".rstrip()


def finished_line(event: PullProgress, now: float | None = None) -> str:
    """The line a stage ends with: how much, how long, how fast."""
    elapsed = event.elapsed(now)
    timing = ""
    if elapsed is not None:
        rate = rate_text(event, now)
        timing = f" in {duration(elapsed)}" + (f" ({rate})" if rate else "")
    return f"{event.title} done: {amount(event.done, event.unit)}{timing}  {event.message}".rstrip()
