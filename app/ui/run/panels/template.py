"""The chat template as rendered for this request, special tokens marked, with each part's token count.

The tools' block (the template's own tool syntax, or the generic block reqscope writes for a
template without one) is drawn as its own span: a label with its token count where it starts,
its text in its own colour, so the prompt tokens the tools cost are seen at once.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.events import PromptEvent
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame

TOOLS_PART = "tools"  # the part the template's own tool syntax renders
GENERIC_TOOLS_PART = "tools (reqscope)"  # the block reqscope writes when the template has no tool syntax
TOOLS_STYLE = "cyan"


def is_tools_part(name: str) -> bool:
    """Whether a prompt part is the tools' block (the template's own or reqscope's generic one)."""
    return name in (TOOLS_PART, GENERIC_TOOLS_PART)


def tools_label(name: str, tokens: int) -> str:
    """`[tools: 187 tokens, reqscope's own block: this template has no tool syntax]`, the span's label."""
    whose = ", reqscope's own block: this template has no tool syntax" if name == GENERIC_TOOLS_PART else \
        ", the template's own tool syntax"  # fmt: skip
    return f"[tools: {tokens} tokens{whose}]"


class TemplatePanel(Panel):
    """The counts per part (summing to the prompt length), then the rendered prompt as far as it fits."""

    TITLE = "Chat template"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        prompt = frame.view.prompt
        if prompt is None:
            return Text("the template renders at the gateway's next stage", style="dim")
        counts = Text(no_wrap=True, overflow="ellipsis")
        for i, part in enumerate(prompt.parts):
            counts.append(" + " if i else "")
            counts.append(f"{part.tokens}", style="bold")
            counts.append(f" {part.name}", style=TOOLS_STYLE if is_tools_part(part.name) else "")
        counts.append(f" = {sum(p.tokens for p in prompt.parts)} tokens", style="bold")
        return Group(counts, _body(prompt, width * max(height - 1, 1)))


def _body(prompt: PromptEvent, budget: int) -> Text:
    """The rendered prompt piece by piece, the tools' span labelled; at most about `budget` characters."""
    tokens = {p.name: p.tokens for p in prompt.parts}
    names = prompt.token_parts if len(prompt.token_parts) == len(prompt.pieces) else ()
    body = Text()
    previous = ""
    for i, piece in enumerate(prompt.pieces):
        if len(body) >= budget:  # never build more text than the panel can show
            body.append(" …", style="dim")
            break
        part = names[i] if names else ""
        tools = is_tools_part(part)
        if tools and part != previous:
            body.append(tools_label(part, tokens.get(part, 0)), style=f"bold {TOOLS_STYLE}")
            body.append("\n")
        previous = part
        shown = piece.text.replace("\n", "⏎\n")
        style = "reverse" if piece.special else ""
        body.append(shown, style=f"{style} {TOOLS_STYLE}".strip() if tools else style)
    return body
