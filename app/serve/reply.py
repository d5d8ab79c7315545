"""A reply's visible text as the client receives it: plain text, or content and tool calls.

A chat request that offers tools and lets the model use them (`tool_choice` other than "none")
has its text read by `ToolCallStream`: content goes out as content, a call as `tool_calls`
deltas, and the reply finishes with "tool_calls" when it made one (a `length` end stays
`length`, as vLLM's does). Every other request passes its text through unchanged, one chunk per
token, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.text.tool_calls import StreamPiece, ToolCallDelta, ToolCallStream, parse_tool_calls
from minengine.text.tools import ToolCall
from reqscope.openai.responses import TOOL_CALLS_FINISH
from reqscope.openai.schema import ApiRequest

# The engine's reasons for a reply that ended on its own; one that made a call then ends "tool_calls".
_NATURAL_ENDS = frozenset({"stop", "stop_sequence"})


def reads_tool_calls(api: ApiRequest) -> bool:
    """Whether the reply's text is read for tool calls."""
    generation = api.generation
    return api.kind == "chat" and bool(generation.tools) and generation.tool_choice.mode != "none"


@dataclass(frozen=True)
class WholeReply:
    """A finished reply as the non-streaming response carries it."""

    content: str
    tool_calls: tuple[ToolCall, ...] | None  # None: a request without tools (no `tool_calls` key)
    finish_reason: str  # the engine's, or "tool_calls"


def whole_reply(api: ApiRequest, text: str, engine_reason: str) -> WholeReply:
    """`text` split into content and calls when the request reads them."""
    if not reads_tool_calls(api):
        return WholeReply(text, None, engine_reason)
    generation = api.generation
    content, calls = parse_tool_calls(text, generation.tools, generation.parallel_tool_calls)
    return WholeReply(content, calls, _finish(engine_reason, calls))


class StreamedReply:
    """The pieces of a streamed reply, one push per token."""

    def __init__(self, api: ApiRequest) -> None:
        generation = api.generation
        self.tools = reads_tool_calls(api)
        self._stream = ToolCallStream(generation.tools, generation.parallel_tool_calls) if self.tools else None

    def push(self, text: str) -> tuple[StreamPiece, ...]:
        """What a token's text lets go out now: one piece per chunk. Plain requests always get
        one (empty while the token shows no text yet); a request with tools gets none while its
        text is held back, and a call's opening apart from its arguments (vLLM's shape)."""
        if self._stream is None:
            return (StreamPiece(text),)
        return _chunks(self._stream.push(text))

    def finish(self) -> tuple[StreamPiece, ...]:
        """What was held back, at the reply's end."""
        return () if self._stream is None else _chunks(self._stream.finish())

    def finish_reason(self, engine_reason: str) -> str:
        """The engine's reason, or "tool_calls" when the reply ended on its own after making a call."""
        return engine_reason if self._stream is None else _finish(engine_reason, self._stream.calls)


def _finish(engine_reason: str, calls: tuple[ToolCall, ...]) -> str:
    return TOOL_CALLS_FINISH if calls and engine_reason in _NATURAL_ENDS else engine_reason


def _chunks(piece: StreamPiece) -> tuple[StreamPiece, ...]:
    """`piece` as chunks: its content first, then each call's opening (with arguments "") and
    each piece of arguments in a chunk of its own."""
    out = [StreamPiece(piece.content)] if piece.content else []
    for delta in piece.tool_calls:
        if delta.id is not None:
            out.append(StreamPiece("", (ToolCallDelta(delta.index, delta.id, delta.name, ""),)))
            if not delta.arguments:
                continue
            delta = ToolCallDelta(delta.index, None, None, delta.arguments)
        out.append(StreamPiece("", (delta,)))
    return tuple(out)
