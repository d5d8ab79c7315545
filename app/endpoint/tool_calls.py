"""The tool calls a streamed answer makes, read piece by piece from `delta.tool_calls` and put together.

OpenAI's streaming shape, as vLLM sends it: the first piece of a call carries its `index`, `id`,
`type` and `function.name` (with `arguments` empty or a first piece of them); later pieces carry
the same `index` and the next part of `function.arguments`. Calls are told apart by `index`
(several may stream in turn when `parallel_tool_calls` allows). A non-streamed answer's
`message.tool_calls` is read as one piece per call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from minengine.text.tools import ToolCall

TOOL_CALLS_FINISH = "tool_calls"  # the finish_reason of an answer that ended in tool calls


@dataclass(frozen=True)
class ToolCallPiece:
    """One `delta.tool_calls[]` entry: a part of the call at `index`."""

    index: int
    id: str | None = None  # the first piece's
    name: str | None = None  # the first piece's
    arguments: str = ""  # the next part of the arguments' JSON text


def parse_tool_call_pieces(raw: object) -> tuple[ToolCallPiece, ...]:
    """The pieces of a `delta.tool_calls` (or `message.tool_calls`) list; malformed entries are left out.

    An entry without `index` (a non-streamed message's list) takes its place in the list."""
    if not isinstance(raw, list):
        return ()
    pieces = []
    for position, entry in enumerate(raw):
        if not isinstance(entry, dict):
            continue
        index = entry.get("index", position)
        function = entry.get("function") if isinstance(entry.get("function"), dict) else {}
        if isinstance(index, bool) or not isinstance(index, int):
            continue
        call_id, name, arguments = entry.get("id"), function.get("name"), function.get("arguments")
        pieces.append(
            ToolCallPiece(
                index=index,
                id=call_id if isinstance(call_id, str) and call_id else None,
                name=name if isinstance(name, str) and name else None,
                arguments=arguments if isinstance(arguments, str) else "",
            )
        )
    return tuple(pieces)


class ToolCallAssembler:
    """Puts the pieces of each call together, in the order of their indexes."""

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}
        self._names: dict[int, str] = {}
        self._arguments: dict[int, list[str]] = {}

    def add(self, pieces: tuple[ToolCallPiece, ...]) -> None:
        """Take one chunk's pieces."""
        for piece in pieces:
            if piece.id is not None:
                self._ids.setdefault(piece.index, piece.id)
            if piece.name is not None:  # the first piece's; a server that repeats it repeats the same
                self._names.setdefault(piece.index, piece.name)
            self._arguments.setdefault(piece.index, []).append(piece.arguments)

    @property
    def started(self) -> bool:
        """Whether any call has begun."""
        return bool(self._arguments)

    def calls(self) -> tuple[ToolCall, ...]:
        """The calls so far (the last may be partial while the stream runs)."""
        return tuple(
            ToolCall(id=self._ids.get(i, ""), name=self._names.get(i, ""), arguments="".join(self._arguments[i]))
            for i in sorted(self._arguments)
        )


def tool_call_text(call: ToolCall) -> str:
    """`get_weather({"city": "Paris"})`, for the plain printer and the stream panel."""
    return f"{call.name or '?'}({call.arguments})"


def arguments_problem(call: ToolCall) -> str | None:
    """Why the call's arguments are not a JSON object (cut off by max_tokens, malformed), or None."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError as exc:
        return f"its arguments are not JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict):
        return f"its arguments are JSON but not an object ({type(value).__name__})"
    return None
