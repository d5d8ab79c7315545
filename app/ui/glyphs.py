"""Small text-drawing helpers shared by the panels: token pieces, bars, sparklines, line plots, numbers, cells."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from rich.style import Style
from rich.text import Text

_SPARKS = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▏▎▍▌▋▊▉█"
_EIGHTHS_UP = " ▁▂▃▄▅▆▇█"
_VISIBLE = {" ": "·", "\n": "⏎", "\t": "⇥", "\r": "␍"}


def show_piece(text: str, limit: int = 16) -> str:
    """A token's text with whitespace made visible, cut to `limit` characters."""
    shown = "".join(_VISIBLE.get(ch, ch if ch.isprintable() else "�") for ch in text) or "∅"
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def prob_style(prob: float | None) -> Style:
    """Colour for a token by how likely the model found it.

    The likelier, the greener; unlikely picks are also underlined so the difference survives
    NO_COLOR's monochrome rendering.
    """
    if prob is None:
        return Style(color="bright_black")
    if prob >= 0.9:
        return Style(color="green", bold=True)
    if prob >= 0.5:
        return Style(color="bright_green")
    if prob >= 0.2:
        return Style(color="yellow")
    if prob >= 0.05:
        return Style(color="dark_orange", underline=True)
    return Style(color="red", underline=True)


def bar(fraction: float, width: int) -> str:
    """A horizontal bar `width` cells wide, filled to `fraction` in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[rest] if rest and full < width else "")
    return text.ljust(width)


def sparkline(values: Sequence[float], width: int) -> str:
    """The last `width` values as one line of block characters, scaled min..max."""
    tail = list(values)[-width:]
    if not tail:
        return ""
    low, high = min(tail), max(tail)
    span = high - low
    if span <= 0:
        return _SPARKS[3] * len(tail)
    return "".join(_SPARKS[min(int((v - low) / span * len(_SPARKS)), len(_SPARKS) - 1)] for v in tail)


def columns(fractions: Sequence[float], height: int, width_each: int = 1) -> list[str]:
    """Vertical bars, one per value in 0..1, as `height` lines from the top row down."""
    lines = []
    for level in range(height, 0, -1):
        cells = []
        for fraction in fractions:
            eighths = round(min(max(fraction, 0.0), 1.0) * height * 8) - (level - 1) * 8
            cells.append(_EIGHTHS_UP[min(max(eighths, 0), 8)] * width_each)
        lines.append("".join(cells))
    return lines


# Braille cells are 2 dots wide and 4 high; the bit of each dot, by (column, row from the top).
_BRAILLE_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


@dataclass(frozen=True)
class PlotSeries:
    """One line of a `plot`: points sorted by x, how to join them, and its style."""

    xs: Sequence[float]
    ys: Sequence[float]
    style: str
    step: bool = False  # hold each value until the next point (a staircase); else straight segments
    dotted: bool = False  # every other dot column only, so it reads apart from solid lines without colour


def plot(series: Sequence[PlotSeries], width: int, height: int, x_max: float, y_max: float) -> list[Text]:
    """Lines in braille dots, `width` x `height` cells, x in 0..x_max and y in 0..y_max (clipped).

    A series is drawn where x lies within its points; each dot column joins its dot to the
    previous column's, so steps and steep lines stay unbroken. Where series share a cell the
    later one's style wins. Costs width x height, whatever the number of points.
    """
    cols, rows = width * 2, height * 4
    bits = [[0] * width for _ in range(height)]
    styles: list[list[str]] = [[""] * width for _ in range(height)]
    for line in series:
        if not line.xs:
            continue
        previous: int | None = None
        for col in range(cols):
            y = _value_at(line, x_max * col / max(cols - 1, 1))
            if y is None or (line.dotted and col % 2):
                previous = None if y is None else previous
                continue
            row = min(max(round(y / y_max * (rows - 1)) if y_max > 0 else 0, 0), rows)
            low, high = (row, row) if previous is None or line.dotted else sorted((previous, row))
            for dot in range(low, min(high, rows - 1) + 1):
                cell_row, sub = height - 1 - dot // 4, 3 - dot % 4
                bits[cell_row][col // 2] |= _BRAILLE_BITS[col % 2][sub]
                styles[cell_row][col // 2] = line.style
            previous = row
    out = []
    for row_bits, row_styles in zip(bits, styles, strict=True):
        text, start = Text(no_wrap=True), 0
        for col in range(1, width + 1):
            if col == width or row_styles[col] != row_styles[start]:  # one span per run of a style
                cells = "".join(chr(0x2800 + b) if b else " " for b in row_bits[start:col])
                text.append(cells, style=row_styles[start] or None)
                start = col
        out.append(text)
    return out


def _value_at(line: PlotSeries, x: float) -> float | None:
    at = bisect.bisect_right(line.xs, x) - 1
    if at < 0 or x > line.xs[-1]:
        return None
    if line.step or at == len(line.xs) - 1:
        return line.ys[at]
    x0, x1, y0, y1 = line.xs[at], line.xs[at + 1], line.ys[at], line.ys[at + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1


def ms(value: float | None, digits: int = 1) -> str:
    """Milliseconds for a table cell, or an en dash when unknown."""
    return "–" if value is None else f"{value:.{digits}f} ms"


def rate(value: float | None) -> str:
    """Tokens per second for a table cell, or an en dash when unknown."""
    return "–" if value is None else f"{value:.1f} tok/s"


def pairs(items: list[tuple[str, str]], width: int) -> list[Text]:
    """Label/value pairs, two to a line when there is room."""
    per_line = 2 if width >= 44 else 1
    cell = width // per_line
    lines = []
    for start in range(0, len(items), per_line):
        line = Text(no_wrap=True)
        for label, value in items[start : start + per_line]:
            line.append(f"{label:<11}", style="dim")
            line.append(value.ljust(cell - 11), style="bold")
        lines.append(line)
    return lines


def duration_text(value_ms: float) -> str:
    """A stage duration in ms, or in seconds from 10 s on."""
    return f"{value_ms / 1000:.2f}s" if value_ms >= 10_000 else f"{value_ms:.1f}ms"


def fit_cell(text: str, width: int) -> str:
    """`text` in a cell `width` wide: one leading space, cut with an ellipsis when too long."""
    text = text if len(text) < width else text[: width - 2] + "…"
    return (" " + text).ljust(width)
