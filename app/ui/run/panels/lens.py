"""The logit lens of the step: what each layer would have said, and where the chosen token forms.

A row per layer: its residual stream through the final norm and the head gives its own top
guess (with the probability) and the rank and probability of the token the step chose. The
first layer where the chosen token is the top guess is marked, and, when it loses the top place
again later, the layer from which it stays there. The basis is said on screen: the whole
vocabulary (a held step's full view), or the step's most likely tokens only (the cheap form a
running decode captures every step), renormalised among themselves.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.inspect.records import LayerLens, StepInspection, StepLens
from reqscope.ui.glyphs import bar, show_piece
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.inside.focus import window_start
from reqscope.ui.run.inside.panel import InsidePanel
from reqscope.ui.run.inside.shown import ShownInspection

_BAR_MIN_WIDTH = 64  # from this width on, a bar of the chosen token's probability ends each row
_HEADER = f"{'layer':>5}  {'top guess':<12} {'p':>6}   {'chosen':>7} {'p':>6}"
_NARROW = 52  # below this width the rows close up (`_NARROW_HEADER`)
_NARROW_HEADER = f"{'lay':>3} {'top guess':<10} {'p':>6} {'rank':>5} {'p':>6}"


def first_top(lens: StepLens) -> int | None:
    """The first layer whose top guess is the chosen token, or None if none is."""
    return next((layer.layer for layer in lens.layers if layer.chosen_rank == 1), None)


class LensPanel(InsidePanel[StepLens]):
    """A summary line, the basis, then a row per layer (windowed round the focus layer when tall)."""

    TITLE = "Logit lens"
    RECORD = "logit lens"
    LIVE_NOTE = ("the lens shows from the next step: it is captured while this panel is on screen "
                 "(paused, the held step over the whole vocabulary)")

    def part(self, inspection: StepInspection) -> StepLens | None:
        return inspection.lens

    def draw_part(self, frame: Frame, shown: ShownInspection, lens: StepLens, width: int,
                  height: int) -> RenderableType:
        first, stays = first_top(lens), lens.forms_at
        lines = [_summary(shown, lens, first), _line(_basis(lens), "dim"),
                 _line(_NARROW_HEADER if width < _NARROW else _HEADER + ("  p(chosen)" if width >= _BAR_MIN_WIDTH
                                                                         else ""), "dim underline")]
        room = max(height - len(lines), 1)
        start = _window(frame.focus.layer, first, len(lens.layers), room)
        for layer in lens.layers[start : start + room]:
            lines.append(_layer_line(layer, lens, first, stays, frame.focus.layer, width))
        return Group(*lines)


def _window(focus: int | None, first: int | None, count: int, room: int) -> int:
    """The first row shown: the focus layer in view (none chosen: the first top-1 layer), and the
    first top-1 layer too where both fit."""
    if focus is None:
        return window_start(first or 0, count, room)
    start = window_start(focus, count, room)
    if first is None or start <= first < start + room:
        return start
    lowest, highest = max(focus - room + 1, 0), min(focus, count - room)
    return min(max(first - room // 2, lowest), highest)


def _summary(shown: ShownInspection, lens: StepLens, first: int | None) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(shown.label, style="italic")
    text.append(f"  chosen {show_piece(lens.chosen_piece, 12)}", style="bold")
    if first is None:
        text.append("  never the top guess before the head")
    else:
        text.append(f"  top-1 from layer {first}", style="bold green")
        if lens.forms_at is not None and lens.forms_at != first:
            text.append(f", stays from {lens.forms_at}")
    text.append(f"  {shown.cost_text}", style="yellow")
    return text


def _basis(lens: StepLens) -> str:
    if lens.basis == "vocab":
        return f"softmax over all {lens.candidates} tokens, rank among them · each layer → final norm → head"
    return (f"over the step's {lens.candidates} likeliest tokens only, renormalised (paused: the whole "
            "vocabulary) · each layer → final norm → head")


def _layer_line(layer: LayerLens, lens: StepLens, first: int | None, stays: int | None, focus: int | None,
                width: int) -> Text:
    is_chosen = layer.chosen_rank == 1
    rank = f"#{layer.chosen_rank}"
    if width < _NARROW:
        line = (f"{layer.layer:>3} {show_piece(layer.top_piece, 10):<10} {layer.top_prob:6.1%} "
                f"{rank:>5} {layer.chosen_prob:6.1%}")
    else:
        line = (f"{layer.layer:>5}  {show_piece(layer.top_piece, 12):<12} {layer.top_prob:6.1%}   "
                f"{rank:>7} {layer.chosen_prob:6.1%}")
    if width >= _BAR_MIN_WIDTH:
        line += "  " + bar(layer.chosen_prob, 10)
    short = width < len(line) + 14  # room for the long mark
    mark = (" ◀ top-1" if short else " ◀ first top-1") if layer.layer == first else (
        (" ◀ stays" if short else " ◀ stays top-1") if layer.layer == stays else "")
    style = ("bold green" if is_chosen else "") + (" reverse" if layer.layer == focus else "")
    text = Text(line, style=style.strip(), no_wrap=True, overflow="ellipsis")
    if mark:
        text.append(mark, style="bold")
    return text


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")
