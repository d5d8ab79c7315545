"""A streaming client for any OpenAI-compatible server, timing the request from the client's side.

`EndpointClient.stream_chat` sends one chat completion and yields ClientEvents as the answer
streams in. The client's timeline (minengine's Timeline, so its events line up with the
engine's vocabulary) records: `client_send`, `connection_new` or `connection_reused`,
`first_byte` (status line and headers), `first_visible_token`, one `token` per chunk of
visible text, `last_visible_token` and `completed`. Connection reuse is observed through
aiohttp's tracing hooks; `new_connection=True` closes every connection after its request so
each request pays for a fresh one and the cost shows.

Where the server offers its own view (vLLM, llama-server: `reqscope.endpoint.server`), the client
also reads the batch around the request while it runs (`BatchPoller`, on this same loop: the
stream and the polls meet in one inbox, each stamped as it is read), the template and tokens the
server made of the messages (once the stream has ended, so as not to load the server during it),
and, with a trace receiver, the server's span for the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp

from minengine.engine.events import Usage
from minengine.engine.request import GenerationRequest
from minengine.engine.timeline import Timeline
from minengine.errors import ReqscopeError
from reqscope.endpoint import events as ev
from reqscope.endpoint.client_metrics import client_metrics, compare_tpot, compare_ttft, output_token_count
from reqscope.endpoint.controls import OPENAI_API, OutputControls
from reqscope.endpoint.options import DEFAULT_POLL_MS
from reqscope.endpoint.server.detect import detect_server
from reqscope.endpoint.server.hints import off_views
from reqscope.endpoint.server.llama import LlamaRouteError, llama_prompt
from reqscope.endpoint.server.otlp import OtlpReceiver
from reqscope.endpoint.server.poller import BatchPoller, pollable
from reqscope.endpoint.server.reconcile import best_split
from reqscope.endpoint.server.records import (
    LLAMA_SERVER,
    VLLM,
    BatchSample,
    PromptProgress,
    ServerKind,
    ServerPrompt,
    ServerView,
    ToolsCost,
)
from reqscope.endpoint.server.vllm import ServerPromptError, vllm_prompt
from reqscope.endpoint.settings import RequestSettings, token_limit_field
from reqscope.endpoint.tool_calls import ToolCallAssembler
from reqscope.endpoint.wire import (
    SSE_DONE,
    StreamChunk,
    body_error,
    chat_body,
    message_dict,
    parse_chunk,
    server_fields,
    sse_data,
)

REQUEST_ID_HEADER = "x-request-id"
SPAN_WAIT_S = 15.0  # vLLM's exporter sends spans in batches every 5 s; past this the span is called missing
_END = object()  # closes a request's inbox: the response has been read


def header_request_id() -> str:
    """A fresh X-Request-Id: a UUID in its dashed form, the one id every server accepts."""
    return str(uuid.uuid4())


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
        poll_ms: float = DEFAULT_POLL_MS,
        otlp_listen: tuple[str, int] | None = None,
        span_wait_s: float = SPAN_WAIT_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.new_connection = new_connection
        self.timeout_s = timeout_s
        self.poll_ms = poll_ms  # 0: do not read the server's batch
        self.otlp_listen = otlp_listen  # where to receive the server's trace spans (OTLP/HTTP), if anywhere
        self.otlp: OtlpReceiver | None = None  # the receiver, while the client is open
        self.span_wait_s = span_wait_s
        self.kind: ServerKind | None = None  # which server it is, asked once (`identify`)
        self._sent: Counter[str] = Counter()  # sends of each request id, so a resend gets an id of its own
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EndpointClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=self.new_connection),
            trace_configs=[_trace_config()],
            timeout=aiohttp.ClientTimeout(total=None, connect=30, sock_read=self.timeout_s),
        )
        if self.otlp_listen is not None:
            host, port = self.otlp_listen
            receiver = OtlpReceiver()
            try:
                await receiver.start(host, port)
            except OSError as exc:
                await self.close()
                raise ReqscopeError(
                    f"--otlp-listen {host}:{port}: cannot listen there ({exc.strerror or exc}); pick a free port"
                ) from None
            self.otlp = receiver
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session and its pooled connections, and stop the trace receiver."""
        if self.otlp is not None:
            await self.otlp.stop()
            self.otlp = None
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

    async def identify(self) -> ServerKind:
        """Which server this is (asked once, before the first request, so no request's timing pays for it)."""
        if self.kind is None:
            self.kind = await detect_server(self._session, self.base_url, self._headers())
        return self.kind

    async def stream_chat(
        self,
        request: GenerationRequest,
        model: str,
        settings: RequestSettings | None = None,
        controls: OutputControls | None = None,
    ) -> AsyncIterator[ev.ClientEvent]:
        """Send `request`'s messages as a streaming chat completion; yield events, ending with StreamEnded
        (and a SpanReceived after it when a trace receiver listens and the server's span arrives).

        Of the sampling, only what `settings` sets goes in the body (none: the server's defaults
        throughout, and no logprobs); `request.sampling`'s filters and `request.max_tokens` are not
        read. The output controls (tools, structured output, penalties, logit bias) are `controls`,
        else those `request` carries (`OutputControls.of`). Raises ReqscopeError, before sending,
        where the server is known not to read one of them.
        """
        settings = settings or RequestSettings()
        controls = controls if controls is not None else OutputControls.of(request)
        kind = await self.identify()
        url = self.base_url + "/chat/completions"
        limit_field = token_limit_field(self.base_url)
        controls.check(OPENAI_API if limit_field != "max_tokens" else kind.name)
        body = chat_body(
            request, model, settings, limit_field, server_fields(kind.name), controls.body_fields(kind.name)
        )
        # Each send carries a fresh UUID as X-Request-Id: the server's records (its span, its logs,
        # vLLM's `chatcmpl-ID` response id) are matched by it. A UUID because llama-cpp-python's
        # server refuses any other form with an empty 400; vLLM and llama-server take any string.
        # The screens keep the request's own `req-…` name (a resend gets a suffix).
        self._sent[request.request_id] += 1
        sends = self._sent[request.request_id]
        display_id = request.request_id if sends == 1 else f"{request.request_id}-{sends}"
        request_id = header_request_id()
        headers = {**self._headers(), REQUEST_ID_HEADER: request_id}
        if kind.name == LLAMA_SERVER:
            # llama-server closes the connection after each stream without saying so; kept in the
            # pool, it would fail the next request on it. Asking for the close keeps it out.
            headers["Connection"] = "close"
        timeline = Timeline()
        send_unix_ms = time.time() * 1000
        t_send = timeline.mark("client_send", url)
        yield ev.RequestSent(
            t_send, url, model, settings, limit_field, request_id, send_unix_ms, request.messages, display_id,
            controls, kind.name,
        )
        reading = _Reading(url, model, timeline)
        inbox: asyncio.Queue = asyncio.Queue()
        poller = None
        tasks = []
        if self.poll_ms > 0 and pollable(kind):
            poller = BatchPoller(self._session, kind, self._headers(), timeline, self.poll_ms,
                                 inbox.put_nowait)
            tasks.append(asyncio.create_task(poller.run()))
        tasks.append(asyncio.create_task(self._read(url, body, headers, reading, inbox)))
        try:
            while (event := await inbox.get()) is not _END:
                reading.note(event)
                yield event
            if poller is not None:  # stop polling; one last reading: the batch as the request ended
                tasks[0].cancel()
                if (last := await poller.poll()) is not None:
                    reading.note(last)
                    yield last
        finally:
            for task in tasks:
                task.cancel()
        prompt, prompt_error, cost, cost_error = None, None, None, None
        if reading.error is None:
            prompt, prompt_error, cost, cost_error = await self._server_prompt(kind, request, model, controls)
        view = ServerView(
            kind=kind,
            request_id=request_id,
            display_id=display_id,
            send_unix_ms=send_unix_ms,
            poll_interval_ms=self.poll_ms if poller is not None else 0.0,
            vllm_metrics=reading.vllm_metrics,
            progress=tuple(reading.progress),
            batch=tuple(reading.batch),
            prompt=prompt,
            prompt_error=prompt_error,
            prompt_token_ids=reading.prompt_token_ids,
            sglang_meta=reading.sglang_meta,
            tools_cost=cost,
            tools_cost_error=cost_error,
        )
        result = reading.result(view)
        off = dict(cached_reported=reading.cached_reported, otlp_listen=self._otlp_listen(),
                   metrics_off=poller is not None and poller.metrics_off,
                   slots_off=poller is not None and poller.slots_off)
        view = _settled(view, result, off_views(view, **off))
        yield ev.StreamEnded(dataclasses.replace(result, server_view=view))
        if self.otlp is not None and kind.name == VLLM and result.error is None:
            span = await self.otlp.wait_for(request_id, self.span_wait_s)
            view = dataclasses.replace(view, span=span)
            yield ev.SpanReceived(_settled(view, result, off_views(view, **off, span_wait_s=self.span_wait_s)))

    def _otlp_listen(self) -> str | None:
        if self.otlp is None:
            return None
        host, port = self.otlp.bound
        return f"{host}:{port}"

    async def _read(
        self, url: str, body: dict, headers: dict[str, str], reading: _Reading, inbox: asyncio.Queue
    ) -> None:
        """Send the request and read its response into `inbox`, closing it with `_END`."""
        timeline = reading.timeline
        probe = _ConnectionProbe(timeline)
        try:
            async with self._session.post(url, json=body, headers=headers, trace_request_ctx=probe) as resp:
                reading.status = resp.status
                reading.request_id = resp.headers.get(REQUEST_ID_HEADER)
                t_first_byte = timeline.mark("first_byte", f"HTTP {resp.status}")
                reading.connection = probe.ready()
                if reading.connection is not None:
                    inbox.put_nowait(reading.connection)
                inbox.put_nowait(ev.ResponseStarted(t_first_byte, resp.status, reading.request_id))
                if resp.status != 200:
                    reading.error = f"HTTP {resp.status}: {body_error(await resp.text())}"
                elif resp.content_type == "application/json":  # a server that ignored `stream`
                    for event in reading.whole(json.loads(await resp.text())):
                        inbox.put_nowait(event)
                else:
                    async for event in reading.stream(resp):
                        inbox.put_nowait(event)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            reading.error = f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")
        inbox.put_nowait(_END)

    async def _server_prompt(
        self, kind: ServerKind, request: GenerationRequest, model: str, controls: OutputControls
    ) -> tuple[ServerPrompt | None, str | None, ToolsCost | None, str | None]:
        """The template and tokens the server made of the request (with its tools, where it offered
        any), or why they could not be read; and, with tools, what they cost in prompt tokens (the
        same messages counted without them), or why that could not be counted."""
        messages = [message_dict(m) for m in request.messages]
        tools = controls.body_fields().get("tools")
        if kind.name not in (VLLM, LLAMA_SERVER):
            return None, None, None, None
        try:
            prompt = await self._count_prompt(kind, model, messages, tools)
        except (ServerPromptError, LlamaRouteError) as exc:
            return None, str(exc), None, None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}", None, None
        if not tools:
            return prompt, None, None, None
        try:
            bare = await self._count_prompt(kind, model, messages, None)
        except (ServerPromptError, LlamaRouteError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return prompt, None, None, f"the prompt without the tools could not be counted: {exc}"
        source = "vLLM /tokenize" if kind.name == VLLM else "llama-server /apply-template + /tokenize"
        return prompt, None, ToolsCost(len(prompt.token_ids), len(bare.token_ids), source), None

    async def _count_prompt(
        self, kind: ServerKind, model: str, messages: list[dict], tools: list[dict] | None
    ) -> ServerPrompt:
        if kind.name == VLLM:
            return await vllm_prompt(self._session, kind.root, model, messages, self._headers(), tools)
        return await llama_prompt(self._session, kind.root, messages, self._headers(), tools)


def _settled(view: ServerView, result: ev.EndpointResult, off: tuple) -> ServerView:
    """`view` with the TTFT split its reports allow and the views that were off."""
    m, timings, report = result.metrics, result.timings, result.server
    split = best_split(
        m.ttft_ms if m is not None else None,
        view.send_unix_ms,
        span=view.span,
        vllm_metrics=view.vllm_metrics,
        llama_prompt_ms=timings.prompt_ms if timings is not None else None,
        progress=view.progress,
        reqscope_ttft_ms=report.ttft_ms if report is not None else None,
        reqscope_queue_ms=report.queue_ms if report is not None else None,
    )
    return dataclasses.replace(view, ttft_split=split, off=off)


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
        self.vllm_metrics = None
        self.prompt_token_ids: tuple[int, ...] | None = None
        self.cached_reported = False
        self.sglang_meta = None
        self.progress: list = []
        self.batch: list = []
        self.tool_calls = ToolCallAssembler()

    def note(self, event: ev.ClientEvent) -> None:
        """Keep what the result needs of an event from the inbox (the batch samples)."""
        if isinstance(event, BatchSample):
            self.batch.append(event)

    async def stream(self, resp: aiohttp.ClientResponse) -> AsyncIterator[ev.ChunkReceived | PromptProgress]:
        # A stream the server closed without [DONE] keeps what arrived.
        async for data in sse_data(resp):
            if data == SSE_DONE:
                break
            chunk = parse_chunk(data)
            if chunk.error is not None:
                self.error = chunk.error
                break
            for event in self._take(chunk):
                yield event

    def whole(self, body: object) -> list[ev.ChunkReceived | PromptProgress]:
        """A non-streamed response: its whole text is one chunk."""
        choice = body.get("choices", [{}])[0] if isinstance(body, dict) else {}
        message = choice.get("message") if isinstance(choice, dict) else None
        text = message.get("content") if isinstance(message, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        finish, logprobs = choice.get("finish_reason"), choice.get("logprobs")
        delta = {"content": text or ""}
        if isinstance(calls, list):  # each whole call as one piece, indexed by its place in the list
            delta["tool_calls"] = calls
        data = {"choices": [{"delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        data.update({k: body[k] for k in ("usage", "reqscope", "timings") if isinstance(body, dict) and k in body})
        return self._take(parse_chunk(json.dumps(data)))

    def _take(self, chunk: StreamChunk) -> list[ev.ChunkReceived | PromptProgress]:
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage
        self.server = chunk.server or self.server
        self.timings = chunk.timings or self.timings  # llama.cpp may send them on every chunk: the last is whole
        self.vllm_metrics = chunk.vllm_metrics or self.vllm_metrics
        self.prompt_token_ids = chunk.prompt_token_ids or self.prompt_token_ids
        self.cached_reported = self.cached_reported or chunk.cached_reported
        self.sglang_meta = chunk.sglang_meta or self.sglang_meta
        self.logprob_tokens += len(chunk.logprobs)
        events: list[ev.ChunkReceived | PromptProgress] = []
        if chunk.progress is not None:
            progress = dataclasses.replace(chunk.progress, t_ms=self.timeline.now_ms())
            self.progress.append(progress)
            events.append(progress)
        # A tool call's pieces are output the model wrote as much as text is: timed alike.
        if not chunk.text and not chunk.tool_calls:
            return events
        self.tool_calls.add(chunk.tool_calls)
        t = self.timeline.mark("token", f"chunk {len(self.texts)}")
        if not self.chunk_times:
            self.timeline.mark("first_visible_token", "chunk 0", t_ms=t)
        itl = t - self.chunk_times[-1] if self.chunk_times else None
        self.texts.append(chunk.text)
        self.chunk_times.append(t)
        events.append(ev.ChunkReceived(len(self.texts) - 1, t, chunk.text, itl, chunk.logprobs, chunk.tool_calls))
        return events

    def result(self, view: ServerView | None = None) -> ev.EndpointResult:
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
            server_view=view,
            tool_calls=self.tool_calls.calls(),
        )
