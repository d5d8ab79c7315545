"""A small OTLP/HTTP trace receiver: vLLM's `llm_request` span for one request, as it exports it.

vLLM started with `--otlp-traces-endpoint http://HOST:PORT/v1/traces` (and
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` in its environment: its default is gRPC) posts
its spans here in batches, a few seconds after each request ends; the load-time spans (`Load
weights`, `Allocate KV cache`, ...) come first, at start-up. Only `llm_request` spans are kept.

The bodies are protobuf `ExportTraceServiceRequest`s, decoded with the `opentelemetry-proto`
package's own generated classes. vLLM reports the span's latencies in seconds (checked against
its per-request metrics, which are in ms); they are kept here in milliseconds.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from aiohttp import web
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from reqscope.endpoint.json_values import count
from reqscope.endpoint.server.records import ServerSpan

SPAN_NAME = "llm_request"
TRACES_PATH = "/v1/traces"
# vLLM names its requests `chatcmpl-ID` when the client sent `X-Request-Id: ID`.
CHAT_PREFIX = "chatcmpl-"
PROTOBUF = "application/x-protobuf"
# One span is a few hundred bytes; a receiver left running beside a long session keeps the latest.
MAX_KEPT = 512

_LATENCIES = {  # ServerSpan field -> attribute, in seconds
    "queue_ms": "gen_ai.latency.time_in_queue",
    "ttft_ms": "gen_ai.latency.time_to_first_token",
    "prefill_ms": "gen_ai.latency.time_in_model_prefill",
    "decode_ms": "gen_ai.latency.time_in_model_decode",
    "inference_ms": "gen_ai.latency.time_in_model_inference",
    "e2e_ms": "gen_ai.latency.e2e",
}
_COUNTS = {"prompt_tokens": "gen_ai.usage.prompt_tokens", "completion_tokens": "gen_ai.usage.completion_tokens"}
_REQUEST_ID = "gen_ai.request.id"


def spans_from_export(body: bytes) -> list[ServerSpan]:
    """The `llm_request` spans in one OTLP export body (a serialized `ExportTraceServiceRequest`).

    Other spans, and `llm_request` spans without a `gen_ai.request.id`, are left out. Raises
    `google.protobuf.message.DecodeError` where the body is not such a message.
    """
    export = ExportTraceServiceRequest.FromString(body)
    found = []
    for resource_spans in export.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if span.name != SPAN_NAME:
                    continue
                attributes = {a.key: _value(a.value) for a in span.attributes}
                request_id = attributes.get(_REQUEST_ID)
                if not isinstance(request_id, str) or not request_id:
                    continue
                found.append(
                    ServerSpan(
                        request_id=request_id,
                        start_unix_ms=span.start_time_unix_nano / 1e6,
                        end_unix_ms=span.end_time_unix_nano / 1e6,
                        **{field: _ms(attributes.get(key)) for field, key in _LATENCIES.items()},
                        **{field: count(attributes.get(key)) for field, key in _COUNTS.items()},
                    )
                )
    return found


def _value(value: AnyValue) -> str | bool | int | float | None:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def _ms(seconds: object) -> float | None:
    # bool is an int to Python, never a latency.
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    return seconds * 1000.0


class OtlpReceiver:
    """Receives vLLM's trace exports on `POST /v1/traces` and hands out the span of one request.

    Every method runs on the event loop that called `start`. Spans are kept by the request id
    vLLM reports, the latest `MAX_KEPT` of them, so a span that arrives before anyone waits for
    it is still found.
    """

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self._max_kept = max_kept
        self._spans: OrderedDict[str, ServerSpan] = OrderedDict()
        self._arrived = asyncio.Event()  # replaced after each arrival, so every waiter wakes once
        self._runner: web.AppRunner | None = None
        self.bound: tuple[str, int] = ("", 0)

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (port 0: a free one; `bound` then names it)."""
        self._arrived = asyncio.Event()  # made on the loop it will be awaited on
        app = web.Application()
        app.router.add_post(TRACES_PATH, self._receive)
        # access_log=None: a line per export would land in the middle of the client's output.
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        address = self._runner.addresses[0]
        self.bound = (str(address[0]), int(address[1]))

    async def stop(self) -> None:
        """Stop listening; spans already received stay readable."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def endpoint(self) -> str:
        """The URL to give vLLM's `--otlp-traces-endpoint`."""
        host, port = self.bound
        return f"http://{host}:{port}{TRACES_PATH}"

    def get(self, request_id: str) -> ServerSpan | None:
        """The span of the request sent with `X-Request-Id: request_id`, if it has arrived."""
        return self._spans.get(request_id) or self._spans.get(CHAT_PREFIX + request_id)

    async def wait_for(self, request_id: str, timeout_s: float) -> ServerSpan | None:
        """That span, as soon as it arrives (or at once if it already has); None after `timeout_s`.

        vLLM reports the id as `chatcmpl-ID` for a chat request sent with `X-Request-Id: ID`; both
        forms match.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (span := self.get(request_id)) is None:
            left = deadline - loop.time()
            if left <= 0:
                return None
            arrived = self._arrived
            try:
                await asyncio.wait_for(arrived.wait(), left)
            except TimeoutError:
                return None
        return span

    async def _receive(self, request: web.Request) -> web.Response:
        content_type = request.content_type
        if content_type != PROTOBUF:
            # The JSON encoding of OTLP names its fields differently (camelCase, hex ids): not read here.
            return web.Response(
                status=415,
                text=f"only {PROTOBUF} is read here; set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf\n",
            )
        # aiohttp undoes `Content-Encoding: gzip` (or deflate) before read() returns the body.
        body = await request.read()
        try:
            spans = spans_from_export(body)
        except DecodeError as error:
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {error}\n")
        for span in spans:
            self._spans[span.request_id] = span
            self._spans.move_to_end(span.request_id)
        while len(self._spans) > self._max_kept:
            self._spans.popitem(last=False)
        if spans:
            arrived, self._arrived = self._arrived, asyncio.Event()
            arrived.set()
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF)
