"""The prompt as the model sees it, and every token: prompt pieces, then output coloured by probability."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.events import TokenEvent
from reqscope.ui.glyphs import prob_style, show_piece
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame

_TEMPLATE_MIN_HEIGHT = 14  # below this the rendered template gives way to the token strip
# Prompt tokens whose K/V came from the prefix cache (not prefilled by this run).
REUSED_STYLE = "green underline"


class TokensPanel(Panel):
    """Per-part counts, the rendered template (when there is room) and the token strip."""

    TITLE = "Prompt & tokens"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        view = frame.view
        if view.prompt is None:
            return Text("templating and tokenizing…", style="dim")
        rows = height - 1
        legend = reused_legend(view.reused_tokens, len(view.prompt.pieces))
        if legend is not None and height >= 3:
            rows -= 1
        else:
            legend = None
        template = []
        if height >= _TEMPLATE_MIN_HEIGHT:
            template = _template_lines(view.prompt.rendered, width, height // 3)
            rows -= len(template)
        head = [self._counts(frame)] + ([legend] if legend is not None else [])
        return Group(*head, *template, *_strip(frame, width, max(rows, 1)))

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


def reused_legend(reused: int, prompt_tokens: int) -> Text | None:
    """The line under the counts when the prefix cache supplied part of the prompt, else None."""
    if reused <= 0:
        return None
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("prompt", style=REUSED_STYLE)
    text.append(f" {reused} reused from the prefix cache", style="bold")
    text.append(f", {prompt_tokens - reused} prefilled")
    return text


def _template_lines(rendered: str, width: int, most: int) -> list[Text]:
    out = []
    for line in rendered.split("\n")[:most]:
        shown = line + "⏎"
        out.append(Text(shown if len(shown) <= width else shown[: width - 1] + "…", style="dim", no_wrap=True))
    return out


def _chip(piece: str, token_id: int, style) -> Text:
    chip = Text(show_piece(piece), style=style)
    chip.append(f"{token_id}", style="dim")
    return chip


def _output_chip(token: TokenEvent, preempted: bool = False) -> Text:
    prob = math.exp(token.trace.chosen_logprob) if token.trace is not None else None
    chip = _chip(token.piece, token.token_id, prob_style(prob))
    if token.forced:
        chip.append("⚑", style="bold")  # picked by the user, not sampled
    if preempted:
        chip.append("⟲", style="bold red")  # the engine took its blocks back after it: recomputed (batch panel)
    return chip


def _strip(frame: Frame, width: int, rows: int) -> list[Text]:
    """The last `rows` lines of prompt chips, a marker and output chips, led by a count of what is above.

    Chips are laid out here, one Text per line, rather than wrapped by Rich: only the tail is
    ever shown, so only the chips that can fit are built.
    """
    view = frame.view
    assert view.prompt is not None
    pieces, tokens = view.prompt.pieces, view.tokens
    reused = view.reused_tokens
    preempted_after = {after for after, _ in view.preemptions}  # tokens out when each preemption came
    total = len(pieces) + 1 + len(tokens)
    chips: list[Text] = []
    used = 0
    for n in range(total - 1, -1, -1):  # newest first
        if n > len(pieces):
            index = n - len(pieces) - 1
            chip = _output_chip(tokens[index], index + 1 in preempted_after)
        elif n == len(pieces):
            chip = Text("▶", style="bold")
        else:
            chip = _chip(pieces[n].text, pieces[n].token_id, prompt_style(pieces[n].special, n < reused))
        used += len(chip) + 1
        if used > width * rows:
            break
        chips.append(chip)
    chips.reverse()
    lines = _wrap(chips, width)[-rows:]
    hidden = total - sum(len(line) for line in lines)
    while hidden and lines[0]:
        marker = Text(f"…{hidden}", style="dim italic")
        if len(marker) + sum(len(c) + 1 for c in lines[0]) <= width:
            lines[0].insert(0, marker)
            break
        lines[0].pop(0)  # make room for the marker on the first line
        hidden += 1
    return [Text(" ", no_wrap=True).join(line) for line in lines]


def prompt_style(special: bool, reused: bool) -> str:
    """A prompt chip's style: special tokens reversed, tokens reused from the prefix cache marked."""
    style = "reverse" if special else ""
    return f"{style} {REUSED_STYLE}".strip() if reused else style


def _wrap(chips: list[Text], width: int) -> list[list[Text]]:
    lines: list[list[Text]] = [[]]
    length = 0
    for chip in chips:
        if lines[-1] and length + 1 + len(chip) > width:
            lines.append([])
            length = 0
        length += len(chip) + (1 if lines[-1] else 0)
        lines[-1].append(chip)
    return lines
