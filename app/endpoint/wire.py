"""The endpoint client's side of the wire: the request body it sends, and reading what streams back.

The body asks for a stream with usage (`stream_options.include_usage`) and, when wanted, top
logprobs. `top_k` and `min_p` are not OpenAI parameters, but vLLM, SGLang, llama.cpp and
`reqscope serve` accept them; they are sent only when switched on, so a plain OpenAI-style
server sees only parameters it knows when they are off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from minengine.engine.events import Usage
from minengine.engine.request import GenerationRequest
from reqscope.endpoint.events import ServerReport
from reqscope.openai.logprobs import TokenLogprob, parse_chat_logprobs

EXTENSION_KEY = "reqscope"


def chat_body(request: GenerationRequest, model: str, top_logprobs: int) -> dict:
    """The JSON body of a streaming chat completion for `request`."""
    s = request.sampling
    body: dict = {
        "model": model,
        "messages": [{"role": m.role, "content": m.content} for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.min_p > 0:
        body["min_p"] = s.min_p
    if s.seed is not None:
        body["seed"] = s.seed
    if request.stop:
        body["stop"] = list(request.stop)
    if top_logprobs > 0:
        body["logprobs"] = True
        body["top_logprobs"] = top_logprobs
    return body


class SseDecoder:
    """Turns the lines of a text/event-stream into the data payload of each event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Give one line (without its newline); returns an event's data when the line ends one."""
        if line == "":
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):  # a comment, e.g. a keep-alive
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass(frozen=True)
class StreamChunk:
    """What one streamed JSON chunk says, in the parts the client uses."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    usage: Usage | None
    server: ServerReport | None
    error: str | None


def parse_chunk(data: str) -> StreamChunk:
    """Read one chunk (chat or plain completion format); malformed JSON becomes an error."""
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as exc:
        return StreamChunk("", (), None, None, None, f"the server sent a chunk that is not JSON: {exc}")
    if not isinstance(raw, dict):
        return StreamChunk("", (), None, None, None, "the server sent a chunk that is not a JSON object")
    if "error" in raw:
        return StreamChunk("", (), None, None, None, error_message(raw))
    text, logprobs, finish = "", (), None
    choices = raw.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = content if isinstance(content, str) else ""
        logprobs = parse_chat_logprobs(choice.get("logprobs"))
        finish = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
    return StreamChunk(text, logprobs, finish, parse_usage(raw.get("usage")), parse_server_report(raw), None)


def parse_usage(raw: object) -> Usage | None:
    """OpenAI's usage object, or None when absent or malformed."""
    if not isinstance(raw, dict):
        return None
    prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Usage(prompt, completion)


def parse_server_report(chunk: dict) -> ServerReport | None:
    """The `reqscope` extension a chunk carries, when it does."""
    raw = chunk.get(EXTENSION_KEY)
    if not isinstance(raw, dict):
        return None
    stages = raw.get("stages_ms") if isinstance(raw.get("stages_ms"), dict) else {}
    events = raw.get("events_ms") if isinstance(raw.get("events_ms"), dict) else {}
    return ServerReport(
        request_id=raw.get("request_id") if isinstance(raw.get("request_id"), str) else None,
        ttft_ms=_number(raw.get("ttft_ms")),
        e2e_ms=_number(raw.get("e2e_ms")),
        tpot_ms=_number(raw.get("tpot_ms")),
        queue_ms=_number(raw.get("queue_wait_ms")),
        output_tokens=raw.get("output_tokens") if isinstance(raw.get("output_tokens"), int) else None,
        stages_ms=tuple((k, float(v)) for k, v in stages.items() if _number(v) is not None),
        events_ms=tuple(sorted(((k, float(v)) for k, v in events.items() if _number(v) is not None), key=_second)),
    )


def error_message(body: object) -> str:
    """The message of an OpenAI-style error object, or the body itself."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        if isinstance(message, str):
            return message
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return str(body)[:300]


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _second(pair: tuple[str, float]) -> float:
    return pair[1]
