"""One benchmark request: sent as a stream, every chunk timed on arrival, on the client's clock.

The times are `time.perf_counter()` read when the line that ends a server-sent event arrives,
so they hold what the network and the client's reading add, as a user would see them. Timed are
the chunks that carry visible text, the seeds' measurement points; with `every_chunk`, every chunk
that carries a choice, as vLLM's client times them. The two part where a server sends a token
whose text is still empty (half a character, a stop string held back): the first sees one gap of
two steps, the second two gaps, and vLLM's role announcement becomes its first token. A
request has failed when no response came (connection refused, a timeout), when the status is
not 200, when the server sends an error object, when the stream ends before `[DONE]` (a
server that closed mid-stream) or when no visible token arrived; the error says which.
Otherwise its metrics are the seeds' formulas (`minengine.engine.metrics`) over the chunk times,
with O from the server's `usage` (one token per chunk when it sends none). A request for structured
output carries `response_format`, and its answer's text is kept, with the finish reason, for
`answers` to check once the run is over; plain runs keep no text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp

from minengine.engine.events import Usage
from minengine.engine.metrics import RequestMetrics, inter_token_gaps
from minengine.sampling.structured import StructuredOutput
from reqscope.bench.serve.prompts import BenchPrompt
from reqscope.bench.serve.response_format import response_format_field
from reqscope.endpoint.client_metrics import client_metrics, output_token_count
from reqscope.endpoint.wire import SSE_DONE, body_error, parse_chunk, sse_data

CHAT_SUFFIX = "/chat/completions"


@dataclass(frozen=True)
class RequestTarget:
    """Where and how every request of a run is sent."""

    url: str  # the full route, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    headers: tuple[tuple[str, str], ...] = ()
    token_limit_field: str = "max_tokens"
    ignore_eos: bool = True
    temperature: float | None = 0.0
    every_chunk: bool = False  # time every chunk with a choice (vLLM's client), not visible text alone
    structured: StructuredOutput | None = None  # sent as response_format; the answers' text is then kept

    @property
    def chat(self) -> bool:
        """Whether the route takes messages (chat) rather than a prompt (completions)."""
        return self.url.rstrip("/").endswith(CHAT_SUFFIX)

    def body(self, prompt: BenchPrompt) -> dict:
        """The JSON body of one streaming request for `prompt`."""
        body: dict = {"model": self.model}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        body[self.token_limit_field] = prompt.output_len
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.structured is not None:
            body["response_format"] = response_format_field(self.structured)
        return body


@dataclass(frozen=True)
class RequestOutcome:
    """What one request measured; `metrics` is None and `error` says why when it failed."""

    prompt_len: int  # the prompt's tokens in the client's tokenizer
    input_tokens: int  # the server's usage.prompt_tokens (chat templates add to it), else prompt_len
    output_tokens: int
    metrics: RequestMetrics | None
    gaps_ms: tuple[float, ...]  # every gap between consecutive chunks: the ITLs
    error: str | None = None
    finish_reason: str | None = None  # the last one the stream sent
    text: str | None = None  # the answer, kept only for a structured-output run

    @property
    def ok(self) -> bool:
        """Whether the request succeeded."""
        return self.error is None


_SENDS = 4  # tries of a request whose connection failed before any byte of a response


async def send_request(session: aiohttp.ClientSession, target: RequestTarget, prompt: BenchPrompt) -> RequestOutcome:
    """Send `prompt` and read its stream to the end; failures come back as an outcome, never raised."""
    reading = _Reading(target.every_chunk, keep_text=target.structured is not None)
    send = _now_ms()
    for attempt in range(_SENDS):
        try:
            async with session.post(target.url, json=target.body(prompt), headers=dict(target.headers)) as resp:
                if resp.status != 200:
                    reading.error = f"HTTP {resp.status}: {body_error(await resp.text())}"
                else:
                    await reading.stream(resp)
        except aiohttp.ClientConnectionError as exc:
            # A pooled connection the server had closed (llama-server ends one after 5 requests) fails
            # before a byte comes back: sent again, with the first send's clock (the pool may hold more).
            if attempt < _SENDS - 1 and not reading.times_ms:
                continue
            reading.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        except (TimeoutError, aiohttp.ClientError) as exc:
            reading.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        break
    return reading.outcome(prompt, send)


class _Reading:
    """One response being read: the chunk times so far, the usage, the first problem."""

    def __init__(self, every_chunk: bool, keep_text: bool = False) -> None:
        self.every_chunk = every_chunk
        self.pieces: list[str] | None = [] if keep_text else None
        self.finish_reason: str | None = None
        self.times_ms: list[float] = []
        self.usage: Usage | None = None
        self.done = False
        self.error: str | None = None

    async def stream(self, resp: aiohttp.ClientResponse) -> None:
        async for data in sse_data(resp):
            arrived = _now_ms()
            if data == SSE_DONE:
                self.done = True
                return
            chunk = parse_chunk(data)
            if chunk.error is not None:
                self.error = chunk.error
                return
            self.usage = chunk.usage or self.usage
            self.finish_reason = chunk.finish_reason or self.finish_reason
            if chunk.text or (self.every_chunk and chunk.choice):
                self.times_ms.append(arrived)
            if chunk.text and self.pieces is not None:
                self.pieces.append(chunk.text)

    def outcome(self, prompt: BenchPrompt, send_ms: float) -> RequestOutcome:
        if self.error is None and not self.done:
            self.error = f"the server closed the stream before [DONE], after {len(self.times_ms)} chunks"
        if self.error is None and not self.times_ms:
            self.error = "the stream ended without a " + ("token" if self.every_chunk else "visible token")
        input_tokens = self.usage.prompt_tokens if self.usage is not None else prompt.prompt_len
        tokens, _source = output_token_count(self.usage, 0, len(self.times_ms))
        if self.error is not None:
            return RequestOutcome(prompt.prompt_len, input_tokens, tokens, None, (), self.error)
        metrics = client_metrics(self.times_ms, tokens, send_ms=send_ms)
        text = "".join(self.pieces) if self.pieces is not None else None
        gaps = inter_token_gaps(self.times_ms)
        return RequestOutcome(prompt.prompt_len, input_tokens, tokens, metrics, gaps, None, self.finish_reason, text)


def _now_ms() -> float:
    return time.perf_counter() * 1000.0
