"""The endpoint request as a client sees it: the client-side pipeline strip, and the answer chunk by chunk."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.endpoint.client_metrics import prompt_count
from reqscope.endpoint.tool_calls import tool_call_text
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.endpoint.view import CLIENT_PIPELINE
from reqscope.ui.glyphs import duration_text, fit_cell
from reqscope.ui.panel import Panel

# Alternate chunks take alternate styles, so where the server cut its stream stays visible.
_CHUNK_STYLES = ("", "on grey23")


class EndpointPipelinePanel(Panel[EndpointFrame]):
    """Two lines: the client's stages, then each one's time on the client clock and a note."""

    WAITING = "connecting…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        current = view.current_stage()
        cell = max(width // len(CLIENT_PIPELINE), 8)
        names, times = Text(no_wrap=True), Text(no_wrap=True)
        for name in CLIENT_PIPELINE:
            duration = view.stage_ms(name)
            style = "bold reverse" if name == current else ("dim" if duration is None else "bold")
            names.append(fit_cell(name, cell), style=style)
            note = view.stage_detail(name)
            shown = "" if duration is None else duration_text(duration) + (f" {note}" if note else "")
            times.append(fit_cell(shown, cell), style="" if style == "bold" else style)
        return Group(names, times)


class AnswerPanel(Panel[EndpointFrame]):
    """The messages sent, a count line (with the tools, output shape and penalties asked), then the streamed
    answer with its chunks shaded apart, and the tool calls it makes."""

    TITLE = "Request & answer"
    WAITING = "sending…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        header = Text(no_wrap=True, overflow="ellipsis")
        for message in frame.request.messages:
            header.append(f"{message.role}: ", style="bold")
            header.append(message.content.replace("\n", " ⏎ ") + "  ")
        tokens, source = view.output_tokens()
        usage = view.result.usage if view.result is not None else None
        counts = Text(no_wrap=True, overflow="ellipsis")
        if usage is not None:
            counts.append(f"prompt {prompt_count(usage)} · ", style="bold")
        limit = frame.settings.max_tokens
        counts.append(f"output {tokens}{'' if limit is None else f'/{limit}'} tokens ({source})", style="bold")
        counts.append(f" in {len(view.chunks)} chunks")
        if view.chunks and tokens > len(view.chunks):
            counts.append(f" · {tokens / len(view.chunks):.2f} tokens per chunk", style="dim")
        if limit is None:
            counts.append(" · max tokens: server default", style="dim")
        asked = view.sent.controls.lines() if view.sent is not None else ()
        if asked:
            counts.append(" · asked: " + "; ".join(asked), style="dim")
        answer = Text()
        for chunk in view.chunks:
            answer.append(chunk.text, style=_CHUNK_STYLES[chunk.index % 2])
        calls = view.tool_calls
        for i, call in enumerate(calls):  # the calls are the answer too: shown as they stream
            answer.append(("\n" if answer.plain else "") + f"tool call {i}: ", style="bold cyan")
            answer.append(tool_call_text(call))
        if not view.chunks:
            answer = Text("no text yet" if not view.done else "no text came back", style="dim")
        lines = answer.wrap(self.app.console, width)
        rows = max(height - 2, 1)
        hidden = len(lines) - rows
        shown = list(lines)[-rows:]
        if hidden > 0:
            shown[0] = Text(f"…{hidden} lines above", style="dim italic")
        return Group(header, counts, *shown)
