"""Client-side metrics: the seeds' worked example, and chunks that carry several tokens."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from minengine.engine.events import Usage
from minengine.engine.request import GenerationRequest
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.client_metrics import client_metrics, output_token_count
from reqscope.endpoint.events import ChunkReceived, StreamEnded
from reqscope.endpoint.wire import SseDecoder
from reqscope.serve.runner import start_in_thread


def test_seed_timeline_one_token_per_chunk():
    # TTFT 190 ms, then 149 gaps of 25 ms: the last of 150 tokens lands at 3,915 ms.
    times = [190 + 25 * i for i in range(150)]
    m = client_metrics(times, output_tokens=150)
    assert m.ttft_ms == 190 and m.e2e_ms == 3915
    assert m.tpot_ms == pytest.approx(25) == pytest.approx(m.itl.mean)
    assert m.decode_output_tokens_per_second == pytest.approx(40.0)
    assert m.whole_request_output_tokens_per_second == pytest.approx(38.31, abs=0.005)


def test_chunks_of_three_tokens_keep_itl_and_tpot_apart():
    # 50 chunks 75 ms apart, each carrying 3 tokens: ITL is per chunk, TPOT per token.
    times = [190 + 75 * i for i in range(50)]
    m = client_metrics(times, output_tokens=150)
    assert m.itl.count == 49 and m.itl.mean == pytest.approx(75)
    assert m.tpot_ms == pytest.approx(49 * 75 / 149)
    assert m.decode_output_tokens_per_second == pytest.approx(149 / (49 * 0.075))


def test_everything_in_one_chunk_has_no_tpot():
    m = client_metrics([120.0], output_tokens=12)
    assert m.ttft_ms == m.e2e_ms == 120 and m.tpot_ms is None and m.itl is None
    assert m.whole_request_output_tokens_per_second == pytest.approx(100.0)


def test_output_tokens_prefer_usage_then_logprobs_then_chunks():
    assert output_token_count(Usage(10, 9), logprob_tokens=0, chunks=3) == (9, "usage")
    assert output_token_count(None, logprob_tokens=9, chunks=3) == (9, "logprobs")
    assert output_token_count(None, logprob_tokens=0, chunks=3) == (3, "chunks")
    assert output_token_count(Usage(10, 2), logprob_tokens=0, chunks=3) == (3, "chunks")  # impossible usage


def test_sse_decoder_joins_data_lines_and_skips_comments():
    decoder = SseDecoder()
    fed = [decoder.feed(line) for line in (": keep-alive", "", "event: x", 'data: {"a":', "data: 1}", "")]
    assert fed == [None, None, None, None, None, '{"a":\n1}']


async def _batched_stream(request: web.Request) -> web.StreamResponse:
    """An OpenAI-style server that writes 3 tokens per chunk, 60 ms apart, and reports usage."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(4):
        await asyncio.sleep(0.06)
        chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i}a w{i}b w{i}c "}, "finish_reason": None}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}
    await response.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: " + json.dumps(usage).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


def test_client_against_a_server_that_batches_tokens():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _batched_stream)
    server = start_in_thread(app, "127.0.0.1", 0)
    try:

        async def collect():
            async with EndpointClient(server.url + "/v1") as client:
                return [e async for e in client.stream_chat(GenerationRequest.from_prompt("hi"), "any")]

        events = asyncio.run(collect())
    finally:
        server.stop()
    chunks = [e for e in events if isinstance(e, ChunkReceived)]
    result = events[-1].result
    assert isinstance(events[-1], StreamEnded) and result.error is None
    assert len(chunks) == result.chunks == 4 and result.finish_reason == "length"
    assert (result.output_tokens, result.output_tokens_source) == (12, "usage")
    m = result.metrics
    gaps = [c.itl_ms for c in chunks[1:]]
    assert m.itl.count == 3 and m.itl.mean == pytest.approx(sum(gaps) / 3)
    assert all(g >= 50 for g in gaps)  # the server's 60 ms pacing, seen from the client
    # TPOT spreads the same decode time over 11 tokens, not 3 chunk gaps.
    assert m.tpot_ms == pytest.approx((m.e2e_ms - m.ttft_ms) / 11) == pytest.approx(m.itl.mean * 3 / 11)
    assert result.server is None and result.ttft is None  # not reqscope serve: no server view
    assert result.text == "w0a w0b w0c w1a w1b w1c w2a w2b w2c w3a w3b w3c "
