"""Tool calls out of a reply's text, as it streams and once it is whole.

Forms read:

- Hermes/Qwen2.5 (what vLLM's `hermes` parser reads and what reqscope's generic tool block asks
  for): `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number of them. Text
  before the first tag is content, verbatim; whitespace between and after calls is not content;
  other text after a call is content.
- Inside a tag, `"parameters"` is read in place of `"arguments"` (as llama.cpp's generic parser
  reads both), and the keys may come in any order (such a call is sent whole when its tag closes).
- A bare reply that is nothing but one JSON object `{"name": ..., "arguments"|"parameters": ...}`
  (llama.cpp's generic form): when tools are offered and a reply's first visible character is
  `{`, the reply is held to its end and then read as a call, or else sent as content.

A call whose name is not among the request's tools, or whose text does not parse, stays content,
tags included (vLLM's hermes parser leaves unparsable text as content too).

Streaming, as vLLM's hermes parser streams: a call is announced (index, id, name) as soon as its
canonical opening `{"name": "f", "arguments": {` is read and `f` is a known tool; its arguments
then go out piece by piece, the model's own JSON text. Having announced a call, the stream keeps
it: arguments cut off (`max_tokens`) or malformed after the name are sent as far as they went,
and the call counts. `parse_tool_calls` runs the same reader over a whole reply, so the two agree.
Every decision depends on the text only, never on how it was split into pushes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from minengine.text.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, ToolCall

# The canonical opening of a call, up to the `{` that starts its arguments. Names are plain
# identifiers in practice; `<` is excluded so a name can never run over a closing tag.
_CALL_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\<]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

_Mode = Literal["start", "outside", "block", "arguments", "tail", "bare"]


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of one call, as OpenAI's streamed `tool_calls[i]` carries it."""

    index: int  # which call of this reply (0, 1, ...)
    id: str | None  # on a call's first delta only ("call_" + 24 hex)
    name: str | None  # on a call's first delta only
    arguments: str  # the next piece of the call's arguments JSON text ("" allowed)


@dataclass(frozen=True)
class StreamPiece:
    """What may go out now: content text, and tool-call deltas (in order, merged per call)."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def new_call_id() -> str:
    """A fresh call id in OpenAI's shape: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _whole_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call written as one JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass
class _Scan:
    """Where the arguments JSON stands: depth of brackets, and whether inside a string."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


@dataclass
class _OpenCall:
    index: int
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    scan: _Scan = field(default_factory=_Scan)


class ToolCallStream:
    """Reads a reply's visible text as it streams; splits content from tool calls.

    Text that may be the start of a tag is held back until it is known. See the module docstring
    for the forms read.
    """

    def __init__(self, tools: tuple[Tool, ...], parallel: bool = True) -> None:
        self._names = frozenset(t.name for t in tools)
        self._parallel = parallel
        self._mode: _Mode = "start" if tools else "outside"
        self._pending = ""  # received, not yet sent or dropped
        self._after_call = False  # whitespace right after a call is dropped
        self._open: _OpenCall | None = None
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The complete calls parsed so far."""
        return tuple(self._calls)

    def push(self, text: str) -> StreamPiece:
        """Newly visible text of the reply; returns what may go out now."""
        self._pending += text
        while self._advance():
            pass
        return self._take()

    def finish(self) -> StreamPiece:
        """The end of the reply: flush what was held back."""
        while self._advance():
            pass
        if self._mode == "bare":
            whole = _whole_call(self._pending)
            if whole is not None and whole[0] in self._names:
                self._add_whole_call(*whole)
                self._pending = ""
            else:  # not a call after all: read it as any other text
                self._mode = "outside"
                while self._advance():
                    pass
        pending, self._pending = self._pending, ""
        if self._mode in ("start", "outside"):
            self._emit_outside(pending)
        elif self._mode == "block":
            self._close_block(pending, closed=False)
        elif self._mode == "arguments":
            self._close_open_call()
        self._mode = "outside"
        return self._take()

    # -- one step of the reader; True when it changed state and may go on --------------------

    def _advance(self) -> bool:
        if not self._pending:
            return False
        mode = self._mode
        if mode == "start":
            stripped = self._pending.lstrip()
            if not stripped:
                return False  # only whitespace so far: a bare call may still follow
            self._mode = "bare" if stripped.startswith("{") else "outside"
            return self._mode == "outside"
        if mode == "outside":
            return self._read_outside()
        if mode == "block":
            return self._read_block()
        if mode == "arguments":
            return self._read_arguments()
        if mode == "tail":
            return self._read_tail()
        return False  # "bare": held to the end

    def _read_outside(self) -> bool:
        at = self._pending.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._emit_outside(self._pending[:at])
            self._pending = self._pending[at + len(TOOL_CALL_OPEN) :]
            self._mode = "block"
            return True
        keep = _partial_suffix(self._pending, TOOL_CALL_OPEN)
        self._emit_outside(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    def _read_block(self) -> bool:
        opening = _CALL_OPENING.match(self._pending)
        close = self._pending.find(TOOL_CALL_CLOSE)
        if opening is not None and (close < 0 or opening.end() < close) and self._accepts_call():
            try:
                name = json.loads(f'"{opening.group(1)}"')
            except json.JSONDecodeError:
                name = None
            if name in self._names:
                self._open = _OpenCall(len(self._calls), new_call_id(), name)
                self._deltas.append(ToolCallDelta(self._open.index, self._open.id, name, ""))
                self._pending = self._pending[opening.end() :]
                self._mode = "arguments"
                return True
        if close < 0:
            return False  # wait for the tag to close
        self._close_block(self._pending[:close], closed=True)
        self._pending = self._pending[close + len(TOOL_CALL_CLOSE) :]
        self._mode = "outside"
        return True

    def _read_arguments(self) -> bool:
        call = self._open
        assert call is not None
        scan, text = call.scan, self._pending
        sent = 0
        for i, ch in enumerate(text):
            # The tag ends the call even inside a string, as vLLM's `<tool_call>(.*?)</tool_call>`
            # does: a small model's unterminated string must not swallow the rest of the reply.
            if ch == "<":
                rest = text[i:]
                if rest.startswith(TOOL_CALL_CLOSE):  # the tag closed before the arguments did
                    self._send_arguments(text[sent:i])
                    self._close_open_call()
                    self._pending = rest[len(TOOL_CALL_CLOSE) :]
                    self._mode = "outside"
                    return True
                if TOOL_CALL_CLOSE.startswith(rest):  # may be the closing tag: hold it
                    self._send_arguments(text[sent:i])
                    self._pending = rest
                    return False
            scan.step(ch)
            if scan.depth == 0:  # the arguments' closing bracket
                self._send_arguments(text[sent : i + 1])
                self._close_open_call()
                self._pending = text[i + 1 :]
                self._mode = "tail"
                return True
        self._send_arguments(text[sent:])
        self._pending = ""
        return False

    def _read_tail(self) -> bool:
        """After a call's arguments: drop the closing `}` and whitespace up to `</tool_call>`."""
        close = self._pending.find(TOOL_CALL_CLOSE)
        if close >= 0:
            self._pending = self._pending[close + len(TOOL_CALL_CLOSE) :]
            self._mode = "outside"
            return True
        keep = _partial_suffix(self._pending, TOOL_CALL_CLOSE)
        self._pending = self._pending[len(self._pending) - keep :]
        return False

    # -- what a read produces ------------------------------------------------------------------

    def _accepts_call(self) -> bool:
        return self._parallel or not self._calls

    def _close_block(self, body: str, closed: bool) -> None:
        """A tag's whole text: a call, dropped (a second call with parallel calls off), or content."""
        if not self._accepts_call():
            self._after_call = True
            return
        whole = _whole_call(body)
        if whole is not None and whole[0] in self._names:
            self._add_whole_call(*whole)
        else:
            self._emit_outside(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))

    def _add_whole_call(self, name: str, arguments: str) -> None:
        call = ToolCall(new_call_id(), name, arguments)
        self._deltas.append(ToolCallDelta(len(self._calls), call.id, name, arguments))
        self._calls.append(call)
        self._after_call = True

    def _send_arguments(self, piece: str) -> None:
        if piece and self._open is not None:
            self._open.arguments.append(piece)
            self._deltas.append(ToolCallDelta(self._open.index, None, None, piece))

    def _close_open_call(self) -> None:
        call, self._open = self._open, None
        if call is not None:
            self._calls.append(ToolCall(call.id, call.name, "".join(call.arguments)))
            self._after_call = True

    def _emit_outside(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
        self._after_call = False
        self._content.append(text)

    def _take(self) -> StreamPiece:
        content, deltas = "".join(self._content), _merged(self._deltas)
        self._content, self._deltas = [], []
        return StreamPiece(content, deltas)


def _merged(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Consecutive deltas of one call as one (the first keeps the id and name)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and d.id is None:
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return tuple(out)


def parse_tool_calls(text: str, tools: tuple[Tool, ...], parallel: bool = True) -> tuple[str, tuple[ToolCall, ...]]:
    """A whole reply: (its content, the calls). The content is the text before the first call,
    plus any text other than whitespace after it; the same reader as `ToolCallStream`."""
    stream = ToolCallStream(tools, parallel)
    first, last = stream.push(text), stream.finish()
    return first.content + last.content, stream.calls
