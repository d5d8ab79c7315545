"""The chat template and tokens the server itself made of the messages, checked against its usage.

Read once the stream has ended (vLLM's `/tokenize` with the messages, llama-server's
`/apply-template` then `/tokenize`), so the reads never load the server during the request.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from tokenizers import decoders

from reqscope.endpoint.server.words import prompt_line
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.glyphs import show_piece
from reqscope.ui.panel import Panel


class ServerPromptPanel(Panel[EndpointFrame]):
    """The count (against usage.prompt_tokens), cached tokens, what the tools cost, then each token: id and piece."""

    TITLE = "Server's template & tokens"
    WAITING = "read from the server once the stream ends…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        server, result = frame.view.server, frame.view.result
        if server is None or result is None:
            return Text(self.WAITING, style="dim")
        usage = result.usage
        head = prompt_line(server, usage.prompt_tokens if usage else None)
        lines = [Text(head or "this server does not say which tokens it used", no_wrap=True, overflow="ellipsis")]
        lines.append(Text(_cached(frame), style="dim", no_wrap=True, overflow="ellipsis"))
        if server.tools_cost is not None:
            style = "bold yellow" if server.tools_cost.dropped else ""
            lines.append(Text(server.tools_cost.line(), style=style, no_wrap=True, overflow="ellipsis"))
        elif server.tools_cost_error is not None:
            lines.append(Text(f"tools' prompt cost not counted: {server.tools_cost_error}", style="dim"))
        prompt = server.prompt
        if prompt is not None:
            byte_level = _byte_level(prompt.pieces)
            body = Text(overflow="fold")
            for i, token in enumerate(prompt.token_ids):
                body.append(f"{token}", style="dim")
                piece = prompt.pieces[i] if i < len(prompt.pieces) else ""
                piece = _from_byte_level(piece) if byte_level else piece
                body.append(show_piece(piece, 24) if piece else "", style="bold")
                body.append(" ")
            lines.append(body)
        return Group(*lines)


def _cached(frame: EndpointFrame) -> str:
    result = frame.view.result
    if result is None:
        return ""
    timings = result.timings
    if timings is not None and timings.cache_n is not None:
        return f"cached: {timings.cache_n} prompt tokens from its cache (llama-server timings.cache_n)"
    server = result.server_view
    if server is not None and any(o.flag == "--enable-prompt-tokens-details" for o in server.off):
        return "cached: not reported (start vLLM with --enable-prompt-tokens-details)"
    if result.usage is not None:
        return f"cached: {result.usage.cached_tokens} prompt tokens (usage.prompt_tokens_details.cached_tokens)"
    return ""  # a stream that ended without usage (refused, cut): nothing to say


# GPT-2's byte-level alphabet read backwards (`Ġ` a space, `Ċ` a newline), by the tokenizers library.
_BYTE_LEVEL = decoders.ByteLevel()


def _byte_level(pieces: tuple[str, ...]) -> bool:
    """Whether the pieces are a byte-level vocabulary's raw strings (vLLM's token_strs: `Ġare`, `Ċ`)."""
    return any("Ġ" in p or "Ċ" in p for p in pieces)


def _from_byte_level(piece: str) -> str:
    return _BYTE_LEVEL.decode([piece])
