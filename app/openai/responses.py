"""Response bodies and server-sent-event chunks in the OpenAI formats.

A stream is, in order: (chat only) a chunk announcing the assistant role, one chunk per piece
of visible text, a chunk with the finish reason that also carries the server's own
measurements under the `reqscope` extension key, a usage chunk with empty `choices` when
`stream_options.include_usage` asked for one, and `data: [DONE]`. Clients that do not know
the extension key ignore it.

A chat request with tools streams its calls as `tool_calls` deltas in vLLM's shape: a call's
first delta carries `index`, `id`, `type` and `function.name` (with `arguments` ""), the next
ones `index` and a piece of `function.arguments`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from minengine.engine.events import Usage
from minengine.text.tool_calls import ToolCallDelta
from minengine.text.tools import ToolCall
from reqscope.openai.logprobs import TokenLogprob, chat_logprobs_json, completion_logprobs_json
from reqscope.openai.schema import Kind

SSE_DONE = b"data: [DONE]\n\n"
EXTENSION_KEY = "reqscope"

# The engine's finish reasons as the API names them ("abort" as vLLM reports a cancellation).
_API_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "cancelled": "abort"}
TOOL_CALLS_FINISH = "tool_calls"


def api_finish_reason(engine_reason: str) -> str:
    """The OpenAI finish reason for one of the engine's."""
    return _API_FINISH.get(engine_reason, engine_reason)


def tool_call_delta_json(delta: ToolCallDelta) -> dict:
    """One entry of a streamed `delta.tool_calls`: a call's opening (id, type, name) or a piece of its arguments."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def sse(payload: dict) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


def usage_json(usage: Usage) -> dict:
    """OpenAI's usage object, with `prompt_tokens_details.cached_tokens`: the prompt tokens whose
    KV came from the prefix cache (included in prompt_tokens, as OpenAI counts them)."""
    total = usage.prompt_tokens + usage.completion_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ResponseShape:
    """Builds every body of one response: its id, model and creation time stay fixed."""

    kind: Kind
    response_id: str
    model: str
    created: int

    def _envelope(self, choices: list[dict], streaming: bool) -> dict:
        if self.kind == "chat":
            kind = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, entries: Sequence[TokenLogprob] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        return chat_logprobs_json(entries) if self.kind == "chat" else completion_logprobs_json(entries, text_offset)

    def role_chunk(self) -> dict:
        """The first chat chunk: the assistant role, no text yet."""
        delta = {"role": "assistant", "content": ""}
        return self._envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], True)

    def text_chunk(self, text: str, logprobs: Sequence[TokenLogprob] | None, text_offset: int = 0) -> dict:
        """One token's chunk: the text it made visible (empty while none shows yet), with its logprobs."""
        choice: dict = {"index": 0, "logprobs": self._logprobs(logprobs, text_offset), "finish_reason": None}
        if self.kind == "chat":
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        return self._envelope([choice], True)

    def delta_chunk(
        self, content: str, tool_calls: Sequence[ToolCallDelta], logprobs: Sequence[TokenLogprob] | None
    ) -> dict:
        """A chat chunk of a request with tools: content (when there is any) and tool-call deltas."""
        delta: dict = {}
        if content or not tool_calls:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = [tool_call_delta_json(d) for d in tool_calls]
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs, 0), "finish_reason": None}
        return self._envelope([choice], True)

    def finish_chunk(self, engine_reason: str, report: dict) -> dict:
        """The chunk that ends the choice; `report` goes under the extension key. `engine_reason`
        may also be the API's "tool_calls"."""
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": api_finish_reason(engine_reason)}
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return {**self._envelope([choice], True), EXTENSION_KEY: report}

    def usage_chunk(self, usage: Usage) -> dict:
        """The closing chunk `stream_options.include_usage` asks for: no choices, only usage."""
        return {**self._envelope([], True), "usage": usage_json(usage)}

    def full_response(
        self,
        text: str,
        engine_reason: str,
        usage: Usage,
        logprobs: Sequence[TokenLogprob] | None,
        report: dict,
        tool_calls: Sequence[ToolCall] | None = None,
    ) -> dict:
        """The whole non-streaming response. `tool_calls` (a request with tools) adds
        `message.tool_calls`, and empty content is then null, as vLLM answers."""
        choice: dict = {"index": 0, "logprobs": self._logprobs(logprobs, 0)}
        choice["finish_reason"] = api_finish_reason(engine_reason)
        if self.kind == "chat" and tool_calls is not None:
            calls = [call.as_dict() for call in tool_calls]
            choice["message"] = {"role": "assistant", "content": text or None, "tool_calls": calls}
        elif self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope([choice], False), "usage": usage_json(usage), EXTENSION_KEY: report}
