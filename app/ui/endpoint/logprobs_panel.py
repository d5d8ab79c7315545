"""What the server says about its choices: the top logprobs of each token in a chunk, when it returns them.

The endpoint never shows its logits or its sampler, only (when asked) each chosen token's log
probability and its likeliest alternatives. `reqscope serve`, like OpenAI and vLLM, reports the
raw model distribution, before temperature and the filters; the sampling settings shown on top
are what the client asked for, applied on the server (or the server's defaults, where unset).
Logprobs are not asked for unless the user says so, since computing them can slow the server;
the panel says how to ask, and what it costs.
"""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.endpoint.settings import LOGPROBS_COST_NOTE, logprobs_text, settings_text
from reqscope.openai.logprobs import IMPOSSIBLE_LOGPROB, TokenLogprob
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.glyphs import bar, prob_style, show_piece
from reqscope.ui.panel import Panel

_HEADER = f"{'':2}{'#':>2} {'token':<14} {'logprob':>8} {'prob':>7}"
_BAR = 12


class EndpointLogprobsPanel(Panel[EndpointFrame]):
    """The asked-for sampling, the chunk in focus, then each of its tokens with the alternatives."""

    TITLE = "Top logprobs (from the server)"
    WAITING = "sending…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        chain = Text()
        chain.append(settings_text(frame.settings), style="bold")
        chain.append("  (applied by the server)", style="dim")
        if not frame.settings.logprobs:
            return Group(chain, *_off_lines())
        cost = Text(f"{logprobs_text(frame.settings)} · {LOGPROBS_COST_NOTE}: the latency panel shows by how much",
                    style="yellow", no_wrap=True, overflow="ellipsis")
        if not view.chunks:
            return Group(chain, cost, Text("no chunk yet: logprobs arrive with the text", style="dim"))
        if not view.token_logprobs:
            return Group(chain, cost, Text(
                "the server returned no logprobs: it ignores or does not support logprobs/top_logprobs, "
                "so only the text is known",
                style="dim",
            ))
        index = len(view.chunks) - 1 if frame.cursor is None else min(frame.cursor, len(view.chunks) - 1)
        chunk = view.chunks[index]
        first_token = sum(len(c.logprobs) for c in view.chunks[:index])
        focus = Text(no_wrap=True, overflow="ellipsis")
        focus.append(f"chunk {index + 1} of {len(view.chunks)}", style="italic")
        focus.append(f" · {len(chunk.logprobs)} token{'s' if len(chunk.logprobs) != 1 else ''}")
        following = frame.cursor is None
        hint = "  following the newest · ↑↓ pick a chunk" if following else "  ↓ to the last follows the newest"
        focus.append(hint, style="dim")
        lines = [chain, cost, focus]
        for offset, entry in enumerate(chunk.logprobs):
            lines += _token_rows(first_token + offset, entry, width)
        if not chunk.logprobs:
            lines.append(Text("this chunk carries no logprob entries", style="dim"))
        spare = height - len(lines) - 1
        if spare >= 3:
            lines += [Text(""), *_recent(view.token_logprobs, spare)]
        return Group(*lines[: max(height, 1)])


def _off_lines() -> list[Text]:
    """What the panel says when the request did not ask for logprobs."""
    return [
        Text("logprobs off: not asked for, so they cannot slow the server being measured", style="dim"),
        Text("to see them: --logprobs N on the command line, or o, logprobs N, then r "
             "(the top N alternatives per token; 0 = the chosen token's only)", style="dim"),
        Text(f"{LOGPROBS_COST_NOTE}: the latency panel then shows by how much", style="dim"),
    ]


def _prob(logprob: float) -> float:
    return 0.0 if logprob <= IMPOSSIBLE_LOGPROB else math.exp(logprob)


def _token_rows(number: int, entry: TokenLogprob, width: int) -> list[Text]:
    title = Text(no_wrap=True, overflow="ellipsis")
    title.append(f"token {number + 1} ", style="bold")
    title.append(show_piece(entry.token, 16), style=prob_style(_prob(entry.logprob)))
    title.append(f"  logprob {entry.logprob:.3f}  p {_prob(entry.logprob):.1%}")
    rows = [title]
    if not entry.top:
        rows.append(Text("  no alternatives (top_logprobs not returned)", style="dim"))
        return rows
    rows.append(Text(_HEADER[:width], style="dim underline", no_wrap=True))
    for rank, alt in enumerate(entry.top):
        chosen = alt.token == entry.token
        p = _prob(alt.logprob)
        line = Text(no_wrap=True, overflow="ellipsis", style="bold" if chosen else "")
        mark = "▶" if chosen else " "
        line.append(f"{mark} {rank + 1:>2} {show_piece(alt.token, 14):<14} {alt.logprob:8.3f} {p:7.1%} ")
        line.append(bar(p, _BAR), style="cyan")
        rows.append(line)
    if all(alt.token != entry.token for alt in entry.top):
        rows.append(Text(f"  the chosen token is outside the top {len(entry.top)}: sampled, not the argmax",
                         style="yellow", no_wrap=True, overflow="ellipsis"))
    return rows


def _recent(entries: list[TokenLogprob], rows: int) -> list[Text]:
    """The newest tokens with the probability the model gave each."""
    lines = [Text(f"{'token':>6} {'piece':<14} {'p model':>8}", style="dim underline", no_wrap=True)]
    start = max(len(entries) - (rows - 1), 0)
    for n, entry in enumerate(entries[start:], start=start):
        p = _prob(entry.logprob)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{n + 1:>6} ")
        line.append(f"{show_piece(entry.token, 14):<14}", style=prob_style(p))
        line.append(f" {p:8.1%}")
        lines.append(line)
    return lines
