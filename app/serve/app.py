"""`reqscope serve`'s HTTP application: OpenAI-compatible routes over one minengine Engine.

Routes: POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models,
POST /tokenize and /detokenize (vLLM's), GET /metrics (Prometheus) and GET /health. Every
request first passes three middlewares: `access_log` (one log line when it is over),
`openai_errors` (its request ID, and any error as OpenAI's JSON) and `track_requests` (the
connection guard's view of requests). A completion request then passes the gateway
(`Gateway.guard`), has its body read strictly (`body.read_json`, bounded in time), is parsed
into a GenerationRequest, and runs as an engine session on a worker thread (`EngineRun`). A
request with a grammar (structured output, a tool it must call) has it compiled against the
tokenizer first, so one that cannot compile is a 400. The response status is decided only
once the scheduler has admitted the request, so a full queue is a 503 and a request that can
never fit is a 400, never a 200 stream that fails. The engine admits requests by capacity
(what its KV pool holds, up to max_num_seqs), and they decode together in its shared steps;
others wait in its queue, bounded by memory, and their wait is part of their TTFT. A chat
request with tools has its reply read for tool calls (`reply.py`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.engine.scheduler import Scheduler
from minengine.errors import AdmissionError, QueueFullError, RequestError
from minengine.kv.budget_floor import smallest_request_bytes
from minengine.sampling.params import VLLM_ORDER
from minengine.text.chat_template import template_supports_tools
from minengine.text.tool_calls import StreamPiece
from reqscope.openai.errors import ApiError
from reqscope.openai.grammar_check import door_check, needs_door_check
from reqscope.openai.logprobs import TokenLogprob
from reqscope.openai.responses import SSE_DONE, ResponseShape, sse
from reqscope.openai.schema import ApiRequest, Kind, ParseOptions, parse_request
from reqscope.serve.access import access_entry, access_log
from reqscope.serve.body import read_json
from reqscope.serve.connections import CONNECTION_GUARD, ConnectionGuard, ConnectionLimits, track_requests
from reqscope.serve.engine_session import Admitted, Crashed, Ended, EngineRun, Generated, SessionEnd
from reqscope.serve.gateway import Arrival, Gateway, GatewayConfig, error_response, openai_errors
from reqscope.serve.prometheus import CONTENT_TYPE, ServeMetrics, scheduler_state
from reqscope.serve.reply import StreamedReply, whole_reply
from reqscope.serve.telemetry import ServedRequest, TelemetryLog, server_report
from reqscope.serve.tokenize import DETOKENIZE_PATH, TOKENIZE_PATH, tokenize_routes

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class ServeConfig:
    """How the server presents the engine and guards it."""

    model_name: str
    gateway: GatewayConfig = GatewayConfig()
    sampler_order: tuple[str, ...] = VLLM_ORDER
    default_max_tokens: int = 256
    max_queue: int | None = None  # None: bounded by memory (`memory_queue_bound`)
    limits: ConnectionLimits = ConnectionLimits()
    # Tools for a template without tool syntax go into reqscope's own block; False refuses them.
    generic_tools: bool = True


@dataclass(frozen=True)
class _State:
    engine: Engine
    config: ServeConfig
    telemetry: TelemetryLog
    started: int
    metrics: ServeMetrics


_STATE = web.AppKey("reqscope_serve_state", _State)


def memory_queue_bound(engine: Engine) -> int:
    """The queue's default bound: as many requests as the KV pool could ever hold at one block each.

    Like vLLM, the server queues what it cannot run yet rather than refusing it; past this many
    waiting, a request could only wait longer than every one of them already admitted could run,
    so it is refused (503) instead of holding a connection open.
    """
    element = engine.dtype.itemsize
    one = smallest_request_bytes(engine.cfg, "gqa", element, GenerationRequest.block_size)
    return max(16, engine.scheduler.kv_budget_bytes // one)


def serving_scheduler(engine: Engine, max_queue: int | None) -> Scheduler:
    """The engine's KV budget with a queue bounded by `max_queue` (default: by memory); as many
    running requests as the engine's steps hold (they decode together, in its shared steps)."""
    return Scheduler(
        engine.scheduler.kv_budget_bytes,
        max_queue=memory_queue_bound(engine) if max_queue is None else max_queue,
        max_running=engine.steps.limits.max_num_seqs,
        pool=engine.pool,
    )


def build_app(engine: Engine, config: ServeConfig, telemetry: TelemetryLog | None = None) -> web.Application:
    """The aiohttp application serving `engine` (its scheduler is replaced by `serving_scheduler`)."""
    engine.scheduler = serving_scheduler(engine, config.max_queue)
    gateway = Gateway(config.gateway)
    middlewares = [access_log, openai_errors, track_requests]  # the first wraps the rest
    app = web.Application(middlewares=middlewares, client_max_size=config.gateway.max_body_bytes)
    # Read at scrape time, from whichever scheduler the engine has then.
    metrics = ServeMetrics(
        config.model_name, engine.cfg.max_position_embeddings, lambda: scheduler_state(engine.scheduler)
    )
    app[_STATE] = _State(engine, config, telemetry or TelemetryLog(), int(time.time()), metrics)
    app[CONNECTION_GUARD] = ConnectionGuard(config.limits)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", gateway.guard(_models))
    app.router.add_get("/metrics", gateway.guard(_metrics))
    app.router.add_post(CHAT_PATH, gateway.guard(_chat))
    app.router.add_post(COMPLETIONS_PATH, gateway.guard(_completions))
    tokenize, detokenize = tokenize_routes(engine, lambda: parse_options(engine, config), config.limits.body_timeout_s)
    app.router.add_post(TOKENIZE_PATH, gateway.guard(tokenize))
    app.router.add_post(DETOKENIZE_PATH, gateway.guard(detokenize))
    return app


def parse_options(engine: Engine, config: ServeConfig) -> ParseOptions:
    """How request bodies are read for this engine and configuration (the template is read now:
    `--chat-template` may have replaced it after the engine loaded)."""
    template = engine.tokenizer.chat_template
    return ParseOptions(
        config.model_name,
        config.sampler_order,
        config.default_max_tokens,
        vocab_size=engine.cfg.vocab_size,
        template_tools=template is not None and template_supports_tools(template),
        generic_tools=config.generic_tools,
    )


async def _health(request: web.Request) -> web.Response:
    state: _State = request.app[_STATE]
    scheduler = state.engine.scheduler
    return web.json_response(
        {"status": "ok", "model": state.config.model_name, "running": scheduler.running, "waiting": scheduler.waiting}
    )


async def _models(request: web.Request, _arrival: Arrival) -> web.Response:
    state: _State = request.app[_STATE]
    model = {
        "id": state.config.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "reqscope",
        "max_model_len": state.engine.cfg.max_position_embeddings,
    }
    return web.json_response({"object": "list", "data": [model]})


async def _metrics(request: web.Request, _arrival: Arrival) -> web.Response:
    state: _State = request.app[_STATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def _chat(request: web.Request, arrival: Arrival) -> web.StreamResponse:
    return await _complete(request, arrival, "chat")


async def _completions(request: web.Request, arrival: Arrival) -> web.StreamResponse:
    return await _complete(request, arrival, "completion")


async def _complete(request: web.Request, arrival: Arrival, kind: Kind) -> web.StreamResponse:
    state: _State = request.app[_STATE]
    body = await read_json(request, state.config.limits.body_timeout_s)
    api = parse_request(kind, body, arrival.request_id, parse_options(state.engine, state.config))
    if needs_door_check(api.generation):  # off the loop: the first one builds the tokenizer's grammar view
        await asyncio.to_thread(door_check, api.generation, state.engine.tokenizer)
    access = access_entry(request)

    def record(end: SessionEnd) -> None:
        state.metrics.observe(end.result)  # first: a reader waiting on the telemetry then sees it counted
        state.telemetry.write(ServedRequest(end.result, request.path, end.disconnect_ms))
        if access is not None:
            access.engine_ended(end.result)

    def exited() -> None:  # also after a crash, which has no SessionEnd
        if access is not None:
            access.engine_ended(None)

    run = EngineRun(
        state.engine,
        api.generation,
        arrival.timeline,
        top_logprobs=api.top_logprobs,
        on_end=record,
        on_exit=exited,
        on_preempt=state.metrics.preempted,
    )
    if access is not None:
        access.engine_started()
    run.start()
    try:
        first = await run.next()
        if not isinstance(first, Admitted):
            return error_response(_refusal(first, api, state.engine.cfg.max_position_embeddings))
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        shape = ResponseShape(kind, prefix + api.generation.request_id, api.model, int(time.time()))
        if api.stream:
            return await _stream(request, arrival, api, run, shape, state.config.limits.write_timeout_s)
        return await _collect(api, run, shape)
    finally:
        # Reached early only when the handler was cancelled (client gone) or a write failed.
        run.cancel()


def _refusal(item: Ended | Crashed, api: ApiRequest, context: int) -> ApiError:
    """The error status for a request that ended before it was admitted."""
    if isinstance(item, Crashed):
        return ApiError(500, item.message, kind="server_error")
    message = item.result.error or "the request ended before admission"
    if isinstance(item.failure, QueueFullError):
        return ApiError(503, message, kind="server_busy", code="queue_full", retry_after_s=1)
    if isinstance(item.failure, AdmissionError | RequestError):
        prompt_tokens = item.result.usage.prompt_tokens
        if prompt_tokens >= context:  # no max_tokens could help: the prompt is what must change
            field = "messages" if api.kind == "chat" else "prompt"
            return ApiError(
                400,
                f"the prompt is {prompt_tokens} tokens, which leaves no room in the model's context of "
                f"{context}; shorten the {field}",
                param=field,
            )
        return ApiError(400, message, param="max_tokens" if "max_tokens" in message else None)
    return ApiError(500, message, kind="server_error")


async def _stream(
    request: web.Request,
    arrival: Arrival,
    api: ApiRequest,
    run: EngineRun,
    shape: ResponseShape,
    write_timeout_s: float,
) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **arrival.headers}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    if (access := access_entry(request)) is not None:
        access.status = response.status  # what the client got, should it leave mid-stream

    async def send(data: bytes) -> None:
        await write_or_drop(request, response, data, write_timeout_s)

    try:
        # The role chunk goes with the first token, as vLLM's does: load tools (vLLM's own client
        # among them) take TTFT at the first chunk, so one sent before prefill would hide it.
        role = api.kind == "chat"
        streamed = ""
        reply = StreamedReply(api)
        while True:
            item = await run.next()
            if role:
                await send(sse(shape.role_chunk()))
                role = False
            if isinstance(item, Generated):
                # Every token has its chunk, as vLLM's server sends them: one that made no text yet
                # (half a character, a held-back stop prefix) goes with empty content, so a client
                # that times chunks sees each step, not a gap of two. A reply read for tool calls
                # sends what its reader lets out (nothing while a possible tag is held back).
                entries = [] if item.logprob is None else [item.logprob]
                try:
                    data = _chunks(api, shape, reply.push(item.token.text), entries, len(streamed))
                    if data:
                        await send(data)
                finally:
                    if item.written is not None:  # the worker may end the session now (WRITTEN_WAIT_S)
                        item.written.set()
                streamed += item.token.text
            elif isinstance(item, Ended | Crashed):
                await send(_closing(api, shape, item, streamed, reply))
                break
        await response.write_eof()
    except ConnectionError:  # the client went away mid-stream (a reset, or lost while a write waited)
        run.cancel()
    return response


async def write_or_drop(request: web.Request, response: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """Write `data`; a client that takes none of it in for `timeout_s` is disconnected.

    aiohttp's write waits while the socket's buffers are full. A client that stops reading
    without closing would hold that wait, its connection and the response forever; after
    `timeout_s` the connection is aborted and ConnectionResetError raised, as for a client gone.
    The deadline is `asyncio.timeout`'s, not `wait_for`'s: this runs for every streamed token, and
    wait_for wraps each write in a task of its own (17.5 against 5.3 us a write on Python 3.11).
    """
    try:
        async with asyncio.timeout(timeout_s):
            await response.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client read nothing for {timeout_s:g} s") from None


def _chunks(
    api: ApiRequest, shape: ResponseShape, pieces: tuple[StreamPiece, ...], entries: list[TokenLogprob], offset: int
) -> bytes:
    """One token's chunks; its logprobs go with the first (a held-back token's with an empty one)."""
    logprobs = _logprobs(api, entries)
    if not pieces and entries and logprobs is not None:
        pieces = (StreamPiece(),)
    out = b""
    for i, piece in enumerate(pieces):
        chosen = logprobs if i == 0 else _logprobs(api, [])
        if piece.tool_calls:
            out += sse(shape.delta_chunk(piece.content, piece.tool_calls, chosen))
        else:
            out += sse(shape.text_chunk(piece.content, chosen, offset))
    return out


def _closing(
    api: ApiRequest, shape: ResponseShape, item: Ended | Crashed, streamed: str, reply: StreamedReply
) -> bytes:
    """Everything after the last token: leftover text (and what the tool-call reader held back),
    finish (or error), usage, [DONE]."""
    if isinstance(item, Crashed):
        return sse(ApiError(500, item.message, kind="server_error").body()) + SSE_DONE
    result = item.result
    tail = result.text[len(streamed) :] if result.text.startswith(streamed) else ""
    pieces = (reply.push(tail) if tail else ()) + reply.finish()
    out = _chunks(api, shape, pieces, [], len(streamed))
    if result.error:
        out += sse(ApiError(500, result.error, kind="server_error").body())
    else:
        out += sse(shape.finish_chunk(reply.finish_reason(result.finish_reason), server_report(result)))
        if api.include_usage:
            out += sse(shape.usage_chunk(result.usage))
    return out + SSE_DONE


def _logprobs(api: ApiRequest, entries: list[TokenLogprob]) -> list[TokenLogprob] | None:
    return None if api.top_logprobs is None else entries


async def _collect(api: ApiRequest, run: EngineRun, shape: ResponseShape) -> web.Response:
    logprobs: list[TokenLogprob] = []
    while True:
        item = await run.next()
        if isinstance(item, Generated) and item.logprob is not None:
            logprobs.append(item.logprob)
        elif isinstance(item, Crashed):
            return error_response(ApiError(500, item.message, kind="server_error"))
        elif isinstance(item, Ended):
            result = item.result
            if result.error:
                return error_response(ApiError(500, result.error, kind="server_error"))
            whole = whole_reply(api, result.text, result.finish_reason)
            body = shape.full_response(
                whole.content,
                whole.finish_reason,
                result.usage,
                _logprobs(api, logprobs),
                server_report(result),
                whole.tool_calls,
            )
            return web.json_response(body)
