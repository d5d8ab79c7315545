"""Small text-drawing helpers shared by the panels: token pieces, bars, sparklines, numbers."""

from __future__ import annotations

from collections.abc import Sequence

from rich.style import Style

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


def ms(value: float | None, digits: int = 1) -> str:
    """Milliseconds for a table cell, or an en dash when unknown."""
    return "–" if value is None else f"{value:.{digits}f} ms"


def rate(value: float | None) -> str:
    """Tokens per second for a table cell, or an en dash when unknown."""
    return "–" if value is None else f"{value:.1f} tok/s"
