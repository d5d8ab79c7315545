"""The chat template as rendered for this request, special tokens marked, with each part's token count."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame


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
            counts.append(f" {part.name}")
        counts.append(f" = {sum(p.tokens for p in prompt.parts)} tokens", style="bold")
        body = Text()
        budget = width * max(height - 1, 1)  # never build more text than the panel can show
        for piece in prompt.pieces:
            if len(body) >= budget:
                body.append(" …", style="dim")
                break
            shown = piece.text.replace("\n", "⏎\n")
            body.append(shown, style="reverse" if piece.special else "")
        return Group(counts, body)
