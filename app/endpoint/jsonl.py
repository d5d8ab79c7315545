"""JSON lines for an endpoint request: one object per client event, flushed as it happens.

Records: `sent`, `connection`, `response`, one `chunk` per chunk of visible text, then `done`
(or `error`). Times are milliseconds on the client's clock from the send. `sent` names the
sampling fields the body carried (by their body names) and those left to the server's default;
`done` holds the server's view when it sent one: `server` (reqscope serve's report),
`server_timings` (llama.cpp's `timings`, its field names), `tpot_comparison` and `server_view`
(what vLLM or llama-server said of the request, each part with its source, and the views that
were off with the flag for each). While the request runs, `batch` records carry each poll of the
server's batch and `progress` records llama-server's progress through the prompt; after `done`,
a `server_span` record carries vLLM's span when a trace receiver listens (`--otlp-listen`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import TextIO

from minengine.plan.planner import Plan
from reqscope.console.json_out import emit, metrics_json
from reqscope.endpoint import events as ev
from reqscope.endpoint.controls import OutputControls, shape_line
from reqscope.endpoint.server.records import BatchSample, PromptProgress, ServerView
from reqscope.endpoint.settings import LOGPROBS_COST_NOTE, RequestSettings


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def print_endpoint_jsonl(
    events: AsyncIterator[ev.ClientEvent],
    kv_plan_for: Callable[[ev.EndpointResult], Plan | None] | None = None,
    out: TextIO | None = None,
) -> ev.EndpointResult:
    """Write one record per event; return the result."""
    out = out or sys.stdout
    result: ev.EndpointResult | None = None
    settings: RequestSettings | None = None
    controls: OutputControls | None = None
    async for event in events:
        if isinstance(event, ev.RequestSent):
            settings, controls = event.settings, event.controls
            emit(out, sent_record(event))
        elif isinstance(event, ev.ConnectionReady):
            record = {"event": "connection", "reused": event.reused, "connect_ms": _ms(event.connect_ms)}
            emit(out, {**record, "t_ms": _ms(event.t_ms)})
        elif isinstance(event, ev.ResponseStarted):
            record = {"event": "response", "status": event.status, "request_id": event.request_id}
            emit(out, {**record, "t_ms": _ms(event.t_ms)})
        elif isinstance(event, ev.ChunkReceived):
            emit(out, chunk_record(event))
        elif isinstance(event, BatchSample):
            emit(out, {"event": "batch", **batch_record(event)})
        elif isinstance(event, PromptProgress):
            emit(out, {"event": "progress", "source": "llama-server prompt_progress", **asdict(event)})
        elif isinstance(event, ev.StreamEnded):
            result = event.result
            if result.error:
                emit(out, {"event": "error", "status": result.status, "message": result.error})
            else:
                plan = kv_plan_for(result) if kv_plan_for is not None and result.usage is not None else None
                emit(out, done_record(result, plan, settings, controls))
        elif isinstance(event, ev.SpanReceived) and result is not None:
            result = dataclasses.replace(result, server_view=event.view)
            emit(out, {"event": "server_span", **span_record(event.view)})
    assert result is not None, "a stream always ends with StreamEnded"
    return result


def sent_record(event: ev.RequestSent) -> dict:
    """The request as sent: which sampling fields it carried and which it left to the server."""
    def field(name: str) -> str:
        return event.token_limit_field if name == "max_tokens" else name

    return {
        "event": "sent",
        "request": event.display_id,  # the request's own name
        "x_request_id": event.request_id,  # the UUID sent, by which the server's records name it
        "url": event.url,
        "model": event.model,
        "t_ms": _ms(event.t_ms),
        "sampling": {field(name): value for name, value in event.settings.sent()},
        "server_default": [field(name) for name in event.settings.server_default()],
        "logprobs": logprobs_record(event.settings),
        "controls": event.controls.body_fields(event.server),  # the body's fields for them, as sent
    }


def logprobs_record(settings: RequestSettings | None, tokens: int | None = None) -> dict | None:
    """None when logprobs were not asked for; else what was asked, and the note that they cost the server."""
    if settings is None or not settings.logprobs:
        return None
    record: dict = {"top_logprobs": settings.top_logprobs}
    if tokens is not None:
        record["tokens"] = tokens  # tokens the server returned an entry for
    record["note"] = f"{LOGPROBS_COST_NOTE}: this request's times include that cost"
    return record


def chunk_record(event: ev.ChunkReceived) -> dict:
    """One chunk: its text, arrival, gap since the previous chunk and any logprobs."""
    record = {
        "event": "chunk", "index": event.index, "text": event.text, "t_ms": _ms(event.t_ms), "itl_ms": _ms(event.itl_ms)
    }  # fmt: skip
    if event.tool_calls:
        record["tool_calls"] = [asdict(piece) for piece in event.tool_calls]
    if event.logprobs:
        record["tokens"] = len(event.logprobs)
        record["logprobs"] = [
            {"token": e.token, "logprob": e.logprob, "top": [{"token": t.token, "logprob": t.logprob} for t in e.top]}
            for e in event.logprobs
        ]
    return record


def done_record(
    r: ev.EndpointResult,
    plan: Plan | None,
    settings: RequestSettings | None = None,
    controls: OutputControls | None = None,
) -> dict:
    """The closing record: counts, the tool calls, the output's shape, client metrics, the server's view,
    the logprobs asked and planned KV."""
    server = None
    if r.server is not None:
        server = {**asdict(r.server), "stages_ms": dict(r.server.stages_ms), "events_ms": dict(r.server.events_ms)}
    ttft = None
    if r.ttft is not None:
        ttft = {**asdict(r.ttft), "outside_server_ms": r.ttft.outside_server_ms}
    tpot = None
    if r.tpot is not None:
        tpot = {**asdict(r.tpot), "outside_server_ms": r.tpot.outside_server_ms}
    kv = None
    if plan is not None:
        mem = plan.memory
        kv = {
            "computed_for": plan.arch.name,
            "kv_dtype": plan.inputs.kv_dtype,
            "kv_bytes_per_token": mem.kv_bytes_per_token,
            "prompt_kv_bytes": mem.prompt_kv_bytes,
            "stop_kv_tokens": mem.stop_kv_tokens,
            "stop_kv_bytes": mem.stop_kv_bytes,
        }
    return {
        "event": "done",
        "finish_reason": r.finish_reason,
        "request_id": r.request_id,
        "tool_calls": [asdict(call) for call in r.tool_calls],
        "output_shape": None if controls is None or controls.structured is None else shape_line(
            controls.structured, r.text),
        "usage": None if r.usage is None else asdict(r.usage),
        "output_tokens": r.output_tokens,
        "output_tokens_source": r.output_tokens_source,
        "chunks": r.chunks,
        "connection": {"reused": r.connection_reused, "connect_ms": r.connect_ms},
        "metrics": metrics_json(r.metrics),
        "server": server,
        "ttft_comparison": ttft,
        "server_timings": None if r.timings is None else asdict(r.timings),
        "tpot_comparison": tpot,
        "logprobs": logprobs_record(settings, r.logprob_tokens),
        "kv_planned": kv,
        "server_view": None if r.server_view is None else server_view_record(r.server_view),
    }


def batch_record(sample: BatchSample) -> dict:
    """One poll of the server's batch, its fields by name (None: the server does not export it)."""
    record = asdict(sample)
    record["t_ms"], record["poll_ms"] = _ms(sample.t_ms), _ms(sample.poll_ms)
    return record


def span_record(view: ServerView) -> dict:
    """The server's span for the request once it arrived, and the TTFT split it allows."""
    return {
        "span": None if view.span is None else {"source": "vLLM span llm_request (OTLP)", **asdict(view.span)},
        "ttft_split": None if view.ttft_split is None else asdict(view.ttft_split),
        "off": [asdict(o) for o in view.off],
        "sglang_meta_info": None if view.sglang_meta is None else {
            "source": "SGLang meta_info (untested against a live SGLang)", **asdict(view.sglang_meta)},
    }


def server_view_record(view: ServerView) -> dict:
    """What the server said of the request, each part with its source; the batch samples are their own records."""
    metrics = view.vllm_metrics
    return {
        "server": asdict(view.kind),
        "request_id_sent": view.request_id,
        "request_name": view.display_id,
        "tools_cost": None if view.tools_cost is None else {
            **asdict(view.tools_cost), "tokens": view.tools_cost.tokens, "dropped": view.tools_cost.dropped},
        "tools_cost_error": view.tools_cost_error,
        "send_unix_ms": round(view.send_unix_ms, 3),
        "vllm_metrics": None if metrics is None else {"source": "vLLM per-request metrics", **asdict(metrics)},
        "span": None if view.span is None else {"source": "vLLM span llm_request (OTLP)", **asdict(view.span)},
        "ttft_split": None if view.ttft_split is None else asdict(view.ttft_split),
        "prompt": None if view.prompt is None else asdict(view.prompt),
        "prompt_error": view.prompt_error,
        "prompt_token_ids_returned": None if view.prompt_token_ids is None else list(view.prompt_token_ids),
        "batch_polls": {"count": len(view.batch), "interval_ms": view.poll_interval_ms,
                        "mean_poll_ms": None if view.poll_cost_ms is None else _ms(view.poll_cost_ms)},
        "off": [asdict(o) for o in view.off],
        "sglang_meta_info": None if view.sglang_meta is None else {
            "source": "SGLang meta_info (untested against a live SGLang)", **asdict(view.sglang_meta)},
    }
