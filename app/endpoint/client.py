"""A streaming client for any OpenAI-compatible server, timing the request from the client's side.

`EndpointClient.stream_chat` sends one chat completion and yields ClientEvents as the answer
streams in. The client's timeline (minengine's Timeline, so its events line up with the
engine's vocabulary) records: `client_send`, `connection_new` or `connection_reused`,
`first_byte` (status line and headers), `first_visible_token`, one `token` per chunk of
visible text, `last_visible_token` and `completed`. Connection reuse is observed through
aiohttp's tracing hooks; `new_connection=True` closes every connection after its request so
each request pays for a fresh one and the cost shows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp

from minengine.engine.events import Usage
from minengine.engine.request import GenerationRequest
from minengine.engine.timeline import Timeline
from reqscope.endpoint import events as ev
from reqscope.endpoint.metrics import client_metrics, compare_tpot, compare_ttft, output_token_count
from reqscope.endpoint.settings import RequestSettings, token_limit_field
from reqscope.endpoint.wire import SSE_DONE, StreamChunk, body_error, chat_body, parse_chunk, sse_data

REQUEST_ID_HEADER = "x-request-id"


class _ConnectionProbe:
    """Filled in by aiohttp's tracing hooks while one request acquires its connection."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.opening_ms: float | None = None
        self.opened_ms: float | None = None
        self.reused_ms: float | None = None

    def ready(self) -> ev.ConnectionReady | None:
        """What the hooks saw, as an event; None when they saw nothing (no hooks ran)."""
        if self.opened_ms is not None:
            connect = self.opened_ms - self.opening_ms if self.opening_ms is not None else None
            return ev.ConnectionReady(self.opened_ms, False, connect)
        if self.reused_ms is not None:
            return ev.ConnectionReady(self.reused_ms, True, None)
        return None


def _probe_of(ctx: SimpleNamespace) -> _ConnectionProbe | None:
    probe = getattr(ctx, "trace_request_ctx", None)
    return probe if isinstance(probe, _ConnectionProbe) else None


async def _on_create_start(_session, ctx, _params) -> None:
    if probe := _probe_of(ctx):
        probe.opening_ms = probe.timeline.now_ms()


async def _on_create_end(_session, ctx, _params) -> None:
    if probe := _probe_of(ctx):
        probe.opened_ms = probe.timeline.mark("connection_new", "opened for this request")


async def _on_reuse(_session, ctx, _params) -> None:
    if probe := _probe_of(ctx):
        probe.reused_ms = probe.timeline.mark("connection_reused", "kept alive from an earlier request")


def _trace_config() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_start.append(_on_create_start)
    trace.on_connection_create_end.append(_on_create_end)
    trace.on_connection_reuseconn.append(_on_reuse)
    return trace


class EndpointClient:
    """One OpenAI-compatible server, reached through one aiohttp session (use `async with`)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        new_connection: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.new_connection = new_connection
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EndpointClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=self.new_connection),
            trace_configs=[_trace_config()],
            timeout=aiohttp.ClientTimeout(total=None, connect=30, sock_read=self.timeout_s),
        )
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session and its pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def models(self) -> tuple[str, ...]:
        """Model names from GET /models; raises aiohttp.ClientResponseError on an error status."""
        async with self._session.get(self.base_url + "/models", headers=self._headers()) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=body_error(body))
        data = json.loads(body).get("data", [])
        return tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))

    async def stream_chat(
        self, request: GenerationRequest, model: str, settings: RequestSettings | None = None
    ) -> AsyncIterator[ev.ClientEvent]:
        """Send `request`'s messages as a streaming chat completion; yield events, ending with StreamEnded.

        Of the sampling, only what `settings` sets goes in the body (none: the server's defaults
        throughout, and no logprobs); `request.sampling` and `request.max_tokens` are not read.
        """
        settings = settings or RequestSettings()
        url = self.base_url + "/chat/completions"
        limit_field = token_limit_field(self.base_url)
        body = chat_body(request, model, settings, limit_field)
        timeline = Timeline()
        yield ev.RequestSent(timeline.mark("client_send", url), url, model, settings, limit_field)
        reading = _Reading(url, model, timeline)
        probe = _ConnectionProbe(timeline)
        try:
            async with self._session.post(url, json=body, headers=self._headers(), trace_request_ctx=probe) as resp:
                reading.status = resp.status
                reading.request_id = resp.headers.get(REQUEST_ID_HEADER)
                t_first_byte = timeline.mark("first_byte", f"HTTP {resp.status}")
                reading.connection = probe.ready()
                if reading.connection is not None:
                    yield reading.connection
                yield ev.ResponseStarted(t_first_byte, resp.status, reading.request_id)
                if resp.status != 200:
                    reading.error = f"HTTP {resp.status}: {body_error(await resp.text())}"
                elif resp.content_type == "application/json":  # a server that ignored `stream`
                    for event in reading.whole(json.loads(await resp.text())):
                        yield event
                else:
                    async for event in reading.stream(resp):
                        yield event
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            reading.error = f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")
        yield ev.StreamEnded(reading.result())


class _Reading:
    """The state of one response being read: chunks so far, and the result they add up to."""

    def __init__(self, url: str, model: str, timeline: Timeline) -> None:
        self.url = url
        self.model = model
        self.timeline = timeline
        self.status: int | None = None
        self.request_id: str | None = None
        self.connection: ev.ConnectionReady | None = None
        self.texts: list[str] = []
        self.chunk_times: list[float] = []
        self.logprob_tokens = 0
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.server: ev.ServerReport | None = None
        self.timings: ev.ServerTimings | None = None
        self.error: str | None = None

    async def stream(self, resp: aiohttp.ClientResponse) -> AsyncIterator[ev.ChunkReceived]:
        # A stream the server closed without [DONE] keeps what arrived.
        async for data in sse_data(resp):
            if data == SSE_DONE:
                break
            chunk = parse_chunk(data)
            if chunk.error is not None:
                self.error = chunk.error
                break
            event = self._take(chunk)
            if event is not None:
                yield event

    def whole(self, body: object) -> list[ev.ChunkReceived]:
        """A non-streamed response: its whole text is one chunk."""
        choice = body.get("choices", [{}])[0] if isinstance(body, dict) else {}
        message = choice.get("message") if isinstance(choice, dict) else None
        text = message.get("content") if isinstance(message, dict) else None
        finish, logprobs = choice.get("finish_reason"), choice.get("logprobs")
        data = {"choices": [{"delta": {"content": text or ""}, "finish_reason": finish, "logprobs": logprobs}]}
        data.update({k: body[k] for k in ("usage", "reqscope", "timings") if isinstance(body, dict) and k in body})
        event = self._take(parse_chunk(json.dumps(data)))
        return [] if event is None else [event]

    def _take(self, chunk: StreamChunk) -> ev.ChunkReceived | None:
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage
        self.server = chunk.server or self.server
        self.timings = chunk.timings or self.timings  # llama.cpp may send them on every chunk: the last is whole
        self.logprob_tokens += len(chunk.logprobs)
        if not chunk.text:
            return None
        t = self.timeline.mark("token", f"chunk {len(self.texts)}")
        if not self.chunk_times:
            self.timeline.mark("first_visible_token", "chunk 0", t_ms=t)
        itl = t - self.chunk_times[-1] if self.chunk_times else None
        self.texts.append(chunk.text)
        self.chunk_times.append(t)
        return ev.ChunkReceived(len(self.texts) - 1, t, chunk.text, itl, chunk.logprobs)

    def result(self) -> ev.EndpointResult:
        if self.chunk_times:
            self.timeline.mark("last_visible_token", f"chunk {len(self.chunk_times) - 1}", t_ms=self.chunk_times[-1])
        self.timeline.mark("completed", self.error or (self.finish_reason or "end of stream"))
        tokens, source = output_token_count(self.usage, self.logprob_tokens, len(self.chunk_times))
        metrics = client_metrics(self.chunk_times, tokens) if self.error is None else None
        return ev.EndpointResult(
            url=self.url,
            model=self.model,
            status=self.status,
            request_id=self.request_id,
            finish_reason=self.finish_reason,
            text="".join(self.texts),
            usage=self.usage,
            output_tokens=tokens,
            output_tokens_source=source,
            chunks=len(self.chunk_times),
            timeline=tuple(self.timeline.events),
            metrics=metrics,
            connection_reused=None if self.connection is None else self.connection.reused,
            connect_ms=None if self.connection is None else self.connection.connect_ms,
            server=self.server,
            ttft=compare_ttft(metrics, self.server),
            error=self.error,
            timings=self.timings,
            logprob_tokens=self.logprob_tokens,
            tpot=compare_tpot(metrics, self.server, self.timings),
        )
