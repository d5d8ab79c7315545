"""The endpoint client's side of the wire: the request body it sends, and reading what streams back.

The body asks for a stream with usage (`stream_options.include_usage`) and carries only the
sampling fields the user set (see `reqscope.endpoint.settings`): a plain OpenAI server never
sees `top_k` or `min_p` unless asked to, and every server applies its own defaults to the rest.
Logprobs are asked for only when wanted. What streams back may carry, besides the text, a
`usage` object, `reqscope serve`'s report (the `reqscope` key) and llama.cpp's `timings`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minengine.engine.events import Usage
from minengine.engine.request import GenerationRequest
from minengine.text.chat_template import Message
from reqscope.endpoint.events import ServerReport, ServerTimings
from reqscope.endpoint.json_values import count, figures_from, number
from reqscope.endpoint.server.llama import parse_progress
from reqscope.endpoint.server.records import LLAMA_SERVER, VLLM, PromptProgress, SglangMetaInfo, VllmRequestMetrics
from reqscope.endpoint.server.sglang import parse_meta_info
from reqscope.endpoint.server.vllm import parse_request_metrics, prompt_token_ids
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.tool_calls import ToolCallPiece, parse_tool_call_pieces
from reqscope.openai.logprobs import TokenLogprob, parse_chat_logprobs

if TYPE_CHECKING:
    import aiohttp

EXTENSION_KEY = "reqscope"
TIMINGS_KEY = "timings"  # llama.cpp's server
SSE_DONE = "[DONE]"  # the data of the event that ends an OpenAI stream


def chat_body(
    request: GenerationRequest,
    model: str,
    settings: RequestSettings,
    token_limit_field: str = "max_tokens",
    extras: dict | None = None,
    controls: dict | None = None,
) -> dict:
    """The JSON body of a streaming chat completion: the messages, of the settings only those set,
    `controls`, the fields of the output controls asked for (`OutputControls.body_fields`), and
    `extras`, the server's own fields that make it report on the request (`server_fields`)."""
    body: dict = {
        "model": model,
        "messages": [message_dict(m) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name, value in settings.sent():
        body[token_limit_field if name == "max_tokens" else name] = value
    if request.stop:
        body["stop"] = list(request.stop)
    if settings.top_logprobs is not None:
        body["logprobs"] = True
        # Sent even when 0: llama.cpp's server reads a missing top_logprobs as 20 alternatives.
        body["top_logprobs"] = settings.top_logprobs
    body.update(controls or {})
    body.update(extras or {})
    return body


def message_dict(message: Message) -> dict:
    """One message in OpenAI's form, with an assistant turn's tool calls and a tool result's call id."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [call.as_dict() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def server_fields(kind: str) -> dict:
    """The body fields that ask `kind` to report on this request as it streams.

    vLLM's `return_token_ids` returns the prompt's token ids (what its template made); llama-server's
    `return_progress` sends `prompt_progress` chunks while it processes the prompt. Both add a few
    bytes to the stream and nothing to the server's work on the request; other servers get neither
    (OpenAI's API refuses fields it does not know).
    """
    if kind == VLLM:
        return {"return_token_ids": True}
    if kind == LLAMA_SERVER:
        return {"return_progress": True}
    return {}


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


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The data of each server-sent event of `resp` as its last line arrives, until the server closes
    the stream or sends `SSE_DONE`, which comes last, once the body has been read to its end."""
    decoder = SseDecoder()
    while line := await resp.content.readline():  # aiohttp bounds a line by its read buffer (128 KiB)
        data = decoder.feed(line.decode("utf-8", errors="replace").rstrip("\r\n"))
        if data is None:
            continue
        if data.strip() == SSE_DONE:
            # Read to the end of the body (the chunked terminator): aiohttp pools a connection
            # again only once its response is fully read, and closes it otherwise.
            await resp.content.read()
            yield SSE_DONE
            return
        yield data


@dataclass(frozen=True)
class StreamChunk:
    """What one streamed JSON chunk says, in the parts the client uses."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    usage: Usage | None
    server: ServerReport | None
    error: str | None
    timings: ServerTimings | None = None
    vllm_metrics: VllmRequestMetrics | None = None  # vLLM's per-request metrics (the final usage chunk)
    progress: PromptProgress | None = None  # llama-server's prompt progress; its t_ms is set on arrival
    prompt_token_ids: tuple[int, ...] | None = None  # vLLM's return_token_ids
    cached_reported: bool = False  # the usage carried prompt_tokens_details
    sglang_meta: SglangMetaInfo | None = None  # SGLang's meta_info (untested against a live SGLang)
    choice: bool = False  # it carried a choice: a token's chunk (its text may be empty) or a role's
    tool_calls: tuple[ToolCallPiece, ...] = ()  # the pieces of tool calls its delta carried


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
    text, logprobs, finish, pieces = "", (), None, ()
    choices = raw.get("choices")
    has_choice = isinstance(choices, list) and bool(choices) and isinstance(choices[0], dict)
    if has_choice:
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = content if isinstance(content, str) else ""
        pieces = parse_tool_call_pieces(delta.get("tool_calls")) if isinstance(delta, dict) else ()
        logprobs = parse_chat_logprobs(choice.get("logprobs"))
        finish = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
    usage, report, timings = parse_usage(raw.get("usage")), parse_server_report(raw), parse_timings(raw)
    raw_usage = raw.get("usage")
    return StreamChunk(
        text, logprobs, finish, usage, report, None, timings,
        vllm_metrics=parse_request_metrics(raw),
        progress=parse_progress(raw, 0.0),
        prompt_token_ids=prompt_token_ids(raw),
        cached_reported=isinstance(raw_usage, dict) and isinstance(raw_usage.get("prompt_tokens_details"), dict),
        sglang_meta=parse_meta_info(raw),
        choice=has_choice,
        tool_calls=pieces,
    )


def parse_usage(raw: object) -> Usage | None:
    """OpenAI's usage object, or None when absent or malformed.

    `prompt_tokens_details.cached_tokens` (OpenAI, vLLM, `reqscope serve`) is the part of the
    prompt the server took from its prefix cache; 0 when the server does not say.
    """
    if not isinstance(raw, dict):
        return None
    prompt, completion = count(raw.get("prompt_tokens")), count(raw.get("completion_tokens"))
    if prompt is None or completion is None:
        return None
    details = raw.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt, completion, cached_tokens=min(cached or 0, prompt))


def parse_server_report(chunk: dict) -> ServerReport | None:
    """The `reqscope` extension a chunk carries, when it does."""
    raw = chunk.get(EXTENSION_KEY)
    if not isinstance(raw, dict):
        return None
    stages = raw.get("stages_ms") if isinstance(raw.get("stages_ms"), dict) else {}
    events = raw.get("events_ms") if isinstance(raw.get("events_ms"), dict) else {}
    return ServerReport(
        request_id=raw.get("request_id") if isinstance(raw.get("request_id"), str) else None,
        ttft_ms=number(raw.get("ttft_ms")),
        e2e_ms=number(raw.get("e2e_ms")),
        tpot_ms=number(raw.get("tpot_ms")),
        queue_ms=number(raw.get("queue_wait_ms")),
        output_tokens=raw.get("output_tokens") if isinstance(raw.get("output_tokens"), int) else None,
        stages_ms=tuple((k, float(v)) for k, v in stages.items() if number(v) is not None),
        events_ms=tuple(sorted(((k, float(v)) for k, v in events.items() if number(v) is not None), key=_second)),
    )


def parse_timings(chunk: dict) -> ServerTimings | None:
    """llama.cpp's `timings` object a chunk carries, when it does (some servers send it on every chunk)."""
    raw = chunk.get(TIMINGS_KEY)
    if not isinstance(raw, dict):
        return None
    timings = figures_from(ServerTimings, raw)  # its fields keep llama.cpp's names
    if timings.prompt_ms is None and timings.predicted_ms is None:
        return None  # nothing the client could set beside its own figures
    return timings


def error_message(body: object) -> str:
    """The message of an OpenAI-style error object, or the body itself."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        if isinstance(message, str):
            return message
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return str(body)[:300]


def body_error(body: str) -> str:
    """The message of an error response's body: its OpenAI error object's, else the text itself."""
    try:
        return error_message(json.loads(body))
    except json.JSONDecodeError:
        return body.strip()[:300] or "(empty body)"


def _second(pair: tuple[str, float]) -> float:
    return pair[1]
