"""The prompt as the model sees it, and every token: prompt pieces, then output coloured by probability."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.events import TokenEvent
from reqscope.ui.frame import Frame
from reqscope.ui.glyphs import prob_style, show_piece
from reqscope.ui.panel import Panel

# Wrapping at chip boundaries wastes part of each line; keep the strip inside its rows.
_WRAP_SLACK = 0.8
_TEMPLATE_MIN_HEIGHT = 14  # below this the rendered template gives way to the token strip


class TokensPanel(Panel):
    """Per-part counts, the rendered template (when there is room) and the token strip."""

    TITLE = "Prompt & tokens"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        view = frame.view
        if view.prompt is None:
            return Text("templating and tokenizing…", style="dim")
        lines = [self._counts(frame)]
        rows = height - 1
        if height >= _TEMPLATE_MIN_HEIGHT:
            template = _template_lines(view.prompt.rendered, width, height // 3)
            lines += template
            rows -= len(template)
        lines.append(_strip(frame, width, max(rows, 1)))
        return Group(*lines)

    @staticmethod
    def _counts(frame: Frame) -> Text:
        view = frame.view
        assert view.prompt is not None
        parts = " + ".join(f"{p.tokens} {p.name}" for p in view.prompt.parts)
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"prompt {len(view.prompt.pieces)}", style="bold")
        text.append(f" = {parts}")
        text.append(f"   output {len(view.tokens)}/{frame.max_tokens}", style="bold")
        return text


def _template_lines(rendered: str, width: int, most: int) -> list[Text]:
    out = []
    for line in rendered.split("\n")[:most]:
        shown = line + "⏎"
        out.append(Text(shown if len(shown) <= width else shown[: width - 1] + "…", style="italic", no_wrap=True))
    return out


def _chip(piece: str, token_id: int, style) -> Text:
    chip = Text(show_piece(piece), style=style)
    chip.append(f"{token_id}", style="dim")
    return chip


def _output_chip(token: TokenEvent) -> Text:
    prob = math.exp(token.trace.chosen_logprob) if token.trace is not None else None
    chip = _chip(token.piece, token.token_id, prob_style(prob))
    if token.forced:
        chip.append("⚑", style="bold")  # picked by the user, not sampled
    return chip


def _strip(frame: Frame, width: int, rows: int) -> Text:
    """Prompt chips, a marker, output chips; only the tail that fits in `rows` lines."""
    view = frame.view
    assert view.prompt is not None
    chips = [
        _chip(p.text, p.token_id, "reverse" if p.special else "") for p in view.prompt.pieces
    ]
    chips.append(Text("▶", style="bold"))
    chips += [_output_chip(t) for t in view.tokens]
    budget = int(width * rows * _WRAP_SLACK)
    shown: list[Text] = []
    used = 0
    for chip in reversed(chips):
        if used + len(chip) + 1 > budget:
            break
        shown.append(chip)
        used += len(chip) + 1
    shown.reverse()
    hidden = len(chips) - len(shown)
    if hidden:
        shown.insert(0, Text(f"…{hidden} earlier", style="dim italic"))
    return Text(" ").join(shown)
