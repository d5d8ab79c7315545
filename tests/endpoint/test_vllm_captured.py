"""reqscope.endpoint.server.vllm and .otlp on payloads captured from a real vLLM 0.32 (CPU build).

Captured once with the flags tests/endpoint/test_vllm_live.py uses, on the default model, for
one streamed chat request sent with `X-Request-Id: cap-1` (12 tokens, greedy):

- tests/data/vllm-chat-stream.json: its chunks, one JSON object a line (the `data:` payloads);
- tests/data/vllm-otlp-llm_request.bin: the OTLP export body that carried its `llm_request` span;
- tests/data/vllm-otlp-load.bin: an export of load-time spans (`Warmup (CPU)`, `Allocate KV cache`).

The live module checks the same functions against a running vLLM; these run everywhere.
`scripts/record_vllm_payloads` records them again from a real vLLM (into tests/data, or
`--out DIR`); the few figures pinned below are this recording's, to update with a new one.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import aiohttp
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from reqscope.endpoint.server.otlp import OtlpReceiver, spans_from_export
from reqscope.endpoint.server.records import VllmRequestMetrics
from reqscope.endpoint.server.vllm import parse_request_metrics, prompt_token_ids, vllm_batch_sample

DATA = Path(__file__).resolve().parent.parent / "data"
SPAN_BODY = (DATA / "vllm-otlp-llm_request.bin").read_bytes()
LOAD_BODY = (DATA / "vllm-otlp-load.bin").read_bytes()
CHUNKS = [json.loads(line) for line in (DATA / "vllm-chat-stream.json").read_text().splitlines()]
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def test_spans_from_export_reads_the_llm_request_span_in_ms():
    [span] = spans_from_export(SPAN_BODY)
    assert span.request_id == "chatcmpl-cap-1"
    usage = CHUNKS[-1]["usage"]
    assert (
        (span.prompt_tokens, span.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"]) == (34, 12)
    )
    # Sent in seconds (0.0517657...): the same figure as the per-request metrics' ms.
    metrics = parse_request_metrics(CHUNKS[-1])
    assert span.prefill_ms == pytest.approx(metrics.time_to_first_token_ms, rel=1e-9)
    assert span.decode_ms == pytest.approx(metrics.generation_time_ms, rel=1e-9)
    assert span.queue_ms == pytest.approx(metrics.queue_time_ms, rel=1e-9)
    assert span.inference_ms == pytest.approx(span.prefill_ms + span.decode_ms, rel=1e-9)
    assert span.ttft_ms == pytest.approx(74.61214065551758)
    assert span.e2e_ms == pytest.approx(449.91445541381836)
    assert span.start_unix_ms == pytest.approx(1796403128668.3494)
    assert span.end_unix_ms - span.start_unix_ms == pytest.approx(450.430139)


def test_spans_from_export_leaves_other_spans_out():
    assert [s.name for r in ExportTraceServiceRequest.FromString(LOAD_BODY).resource_spans
            for ss in r.scope_spans for s in ss.spans] == ["Warmup (CPU)", "Allocate KV cache"]  # fmt: skip
    assert spans_from_export(LOAD_BODY) == []
    # An llm_request span whose id attribute is gone cannot be matched to a request: left out.
    export = ExportTraceServiceRequest.FromString(SPAN_BODY)
    span = export.resource_spans[0].scope_spans[0].spans[0]
    kept = [a for a in span.attributes if a.key != "gen_ai.request.id"]
    del span.attributes[:]
    span.attributes.extend(kept)
    assert spans_from_export(export.SerializeToString()) == []


def test_parse_request_metrics_reads_only_the_final_usage_chunk():
    parsed = [parse_request_metrics(c) for c in CHUNKS]
    assert parsed[:-1] == [None] * (len(CHUNKS) - 1)
    assert parsed[-1] == VllmRequestMetrics(
        queue_time_ms=0.04344700005276536,
        time_to_first_token_ms=51.76575600000888,
        generation_time_ms=375.628077999977,
        mean_itl_ms=34.148007090907,
        tokens_per_second=28.077148160261938,
    )
    odd = {"metrics": {"queue_time_ms": True, "mean_itl_ms": "3", "tokens_per_second": 2}}
    assert parse_request_metrics(odd) == VllmRequestMetrics(None, None, None, None, 2.0)
    assert parse_request_metrics({"metrics": {"latency": 1.0}}) is None


def test_prompt_token_ids_come_on_the_first_chunk():
    ids = prompt_token_ids(CHUNKS[0])
    assert ids is not None and len(ids) == CHUNKS[-1]["usage"]["prompt_tokens"]
    assert ids[:2] == (1, 9690)  # <|im_start|> system
    assert [prompt_token_ids(c) for c in CHUNKS[1:]] == [None] * (len(CHUNKS) - 1)


def test_batch_sample_sums_series_but_averages_the_kv_fraction():
    page = "\n".join(
        [
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 34.0',
            'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.79e+09',
        ]
    )
    sample = vllm_batch_sample(page, t_ms=12.0, poll_ms=3.0)
    assert (sample.running, sample.kv_usage, sample.prompt_tokens_total) == (3.0, 0.375, 34.0)
    assert sample.waiting is None and sample.preemptions_total is None  # not on the page: unknown
    assert (sample.t_ms, sample.poll_ms, sample.source) == (12.0, 3.0, "vLLM /metrics")


def test_receiver_answers_exports_and_hands_out_spans():
    async def run():
        receiver = OtlpReceiver(max_kept=2)
        await receiver.start("127.0.0.1", 0)
        assert receiver.bound[1] > 0
        try:
            async with aiohttp.ClientSession() as session:

                async def post(body: bytes, headers: dict) -> tuple[int, bytes]:
                    async with session.post(receiver.endpoint, data=body, headers=headers) as response:
                        return response.status, await response.read()

                waiting = asyncio.create_task(receiver.wait_for("cap-1", 5))
                await asyncio.sleep(0.05)
                assert not waiting.done()
                assert await post(LOAD_BODY, PROTOBUF) == (200, ExportTraceServiceResponse().SerializeToString())
                assert not waiting.done()  # a body without the span does not end the wait
                assert (await post(SPAN_BODY, PROTOBUF))[0] == 200
                span = await asyncio.wait_for(waiting, 1)
                assert span is not None and span.request_id == "chatcmpl-cap-1"
                # Either form of the id matches; an unknown id times out with None.
                assert await receiver.wait_for("chatcmpl-cap-1", 0) == span
                assert await receiver.wait_for("cap-2", 0.05) is None

                status, text = await post(b"{}", {"Content-Type": "application/json"})
                assert status == 415 and b"http/protobuf" in text
                assert (await post(b"\xff\xff\xff", PROTOBUF))[0] == 400

                # The OTLP exporter's gzip compression, and the bound on the spans kept.
                for n in (2, 3):
                    export = ExportTraceServiceRequest.FromString(SPAN_BODY)
                    attributes = export.resource_spans[0].scope_spans[0].spans[0].attributes
                    next(a for a in attributes if a.key == "gen_ai.request.id").value.string_value = f"chatcmpl-cap-{n}"
                    body = gzip.compress(export.SerializeToString())
                    assert (await post(body, {**PROTOBUF, "Content-Encoding": "gzip"}))[0] == 200
                assert receiver.get("cap-3").request_id == "chatcmpl-cap-3"
                assert receiver.get("cap-2") is not None and receiver.get("cap-1") is None
        finally:
            await receiver.stop()

    asyncio.run(run())
