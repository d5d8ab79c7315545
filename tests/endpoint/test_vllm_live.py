"""reqscope.endpoint.server.vllm and .otlp against a real vLLM (0.32, CPU build) on the default model.

The session's vLLM (tests/endpoint/conftest.py) serves the module, with per-request metrics, prompt
token details and its trace exporter pointed at an OtlpReceiver of ours (on a loop in a thread of
its own) while the module runs. One streamed chat request
is sent while /metrics is polled around it; every test reads that exchange. vLLM comes from
scripts/peers/vllm; where it has not been run, the module skips.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from peers import vllm_python
from prometheus_client.parser import text_string_to_metric_families

from reqscope.endpoint.server.otlp import OtlpReceiver
from reqscope.endpoint.server.records import BatchSample, ServerSpan, VllmRequestMetrics
from reqscope.endpoint.server.vllm import (
    ServerPromptError,
    parse_request_metrics,
    prompt_token_ids,
    vllm_batch_sample,
    vllm_prompt,
)

if vllm_python() is None:
    pytest.skip("vLLM is not provisioned: run scripts/peers/vllm", allow_module_level=True)

MODEL = "smollm2"  # the name the session's vLLM serves the default model under (conftest.py)
SPAN_TIMEOUT_S = 15.0
IDLE_TIMEOUT_S = 60.0
# Long enough (about 30 ms a token here) for a /metrics poll to land while it decodes.
MAX_TOKENS = 96
MESSAGES = [{"role": "user", "content": "Name three colors, then tell a short story about each."}]


class LoopThread:
    """An event loop running in a thread of its own: the receiver lives there while tests block."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@dataclass(frozen=True)
class Vllm:
    root: str  # without /v1
    receiver: OtlpReceiver
    thread: LoopThread


@pytest.fixture(scope="module")
def vllm(vllm_server) -> Iterator[Vllm]:
    """The session's vLLM, with a receiver of this module's listening where its spans go."""
    thread = LoopThread()
    receiver = OtlpReceiver()
    thread.call(receiver.start("127.0.0.1", vllm_server.otlp_port))
    try:
        yield Vllm(vllm_server.root, receiver, thread)
    finally:
        thread.call(receiver.stop())
        thread.close()


@dataclass(frozen=True)
class Exchange:
    """One streamed chat request, and the /metrics samples taken before, during and after it."""

    request_id: str
    chunks: list[dict]
    sent_unix_ms: float
    client_ttft_ms: float  # send to the first chunk with a token, on the client's clock
    before: BatchSample
    during: BatchSample
    during_arrived_before_end: bool
    after: BatchSample
    cache_config: dict[str, str]  # vllm:cache_config_info's labels

    @property
    def usage(self) -> dict:
        return self.chunks[-1]["usage"]


@pytest.fixture(scope="module")
def exchange(vllm) -> Exchange:
    return asyncio.run(_exchange(vllm.root, f"reqscope-live-{uuid.uuid4().hex[:12]}"))


async def _exchange(root: str, request_id: str) -> Exchange:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,  # every run decodes MAX_TOKENS tokens: the poll below lands mid-stream
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    async with aiohttp.ClientSession() as session:

        async def sample() -> tuple[BatchSample, str]:
            start = time.perf_counter()
            async with session.get(root + "/metrics") as response:
                text = await response.text()
            now = time.perf_counter()
            return vllm_batch_sample(text, t_ms=(now - t0) * 1000, poll_ms=(now - start) * 1000), text

        t0 = time.perf_counter()
        before, page = await sample()
        # The session's vLLM is shared: a stream another module dropped may still be finishing, and
        # its scheduling would move the counters read here. Start from an idle server.
        deadline = time.perf_counter() + IDLE_TIMEOUT_S
        while (before.running, before.waiting) != (0, 0):
            assert time.perf_counter() < deadline, f"vLLM still busy after {IDLE_TIMEOUT_S} s: {before}"
            await asyncio.sleep(0.2)
            before, page = await sample()
        chunks: list[dict] = []
        poll: asyncio.Task | None = None
        first_token_at = None
        t0 = time.perf_counter()
        sent_unix_ms = time.time() * 1000
        async with session.post(
            root + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}
        ) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                chunks.append(chunk)
                if first_token_at is None and any(c.get("token_ids") for c in chunk.get("choices", ())):
                    first_token_at = time.perf_counter()
                    poll = asyncio.create_task(sample())
        assert poll is not None, "no chunk carried a token"
        arrived_before_end = poll.done()
        during, _ = await poll
        after, _ = await sample()
    return Exchange(
        request_id=request_id,
        chunks=chunks,
        sent_unix_ms=sent_unix_ms,
        client_ttft_ms=(first_token_at - t0) * 1000,
        before=before,
        during=during,
        during_arrived_before_end=arrived_before_end,
        after=after,
        cache_config=_cache_config(page),
    )


def _cache_config(page: str) -> dict[str, str]:
    for family in text_string_to_metric_families(page):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no vllm:cache_config_info on /metrics")


def test_the_final_usage_chunk_carries_consistent_per_request_metrics(exchange):
    parsed = [parse_request_metrics(c) for c in exchange.chunks]
    assert all(p is None for p in parsed[:-1])  # only the final usage chunk has them
    m = parsed[-1]
    assert isinstance(m, VllmRequestMetrics)
    completion = exchange.usage["completion_tokens"]
    assert completion == MAX_TOKENS
    assert m.queue_time_ms >= 0
    assert m.time_to_first_token_ms > 0 and m.generation_time_ms > 0 and m.mean_itl_ms > 0
    # Generation runs from the first token to the last; the mean ITL spreads it over the gaps.
    assert m.mean_itl_ms * (completion - 1) == pytest.approx(m.generation_time_ms, rel=1e-6)
    assert m.tokens_per_second == pytest.approx(
        completion / ((m.time_to_first_token_ms + m.generation_time_ms) / 1000), rel=1e-6
    )
    # The client waited for the queue, the prefill and more (connection, HTTP, delivery).
    assert m.queue_time_ms + m.time_to_first_token_ms <= exchange.client_ttft_ms
    assert m.generation_time_ms < 60_000


def test_the_first_chunk_carries_the_prompt_token_ids(exchange):
    ids = [prompt_token_ids(c) for c in exchange.chunks]
    assert ids[0] is not None and all(i is None for i in ids[1:])
    assert len(ids[0]) == exchange.usage["prompt_tokens"]
    assert exchange.usage["prompt_tokens_details"]["cached_tokens"] == 0  # --enable-prompt-tokens-details


def test_the_receiver_gets_the_requests_span_in_ms(vllm, exchange):
    span = vllm.thread.call(vllm.receiver.wait_for(exchange.request_id, SPAN_TIMEOUT_S))
    assert isinstance(span, ServerSpan), f"no llm_request span for {exchange.request_id} in {SPAN_TIMEOUT_S} s"
    assert span.request_id == exchange.chunks[0]["id"] == f"chatcmpl-{exchange.request_id}"
    assert (span.prompt_tokens, span.completion_tokens) == (
        exchange.usage["prompt_tokens"],
        exchange.usage["completion_tokens"],
    )
    # The span's latencies came in seconds: in ms they equal the per-request metrics (also ms).
    m = parse_request_metrics(exchange.chunks[-1])
    assert span.queue_ms == pytest.approx(m.queue_time_ms, rel=1e-6)
    assert span.prefill_ms == pytest.approx(m.time_to_first_token_ms, rel=1e-6)
    assert span.decode_ms == pytest.approx(m.generation_time_ms, rel=1e-6)
    assert span.inference_ms == pytest.approx(span.prefill_ms + span.decode_ms, rel=1e-6)
    # Its TTFT counts from arrival: the queue and the prefill are inside it, and it is inside e2e.
    assert span.queue_ms + span.prefill_ms <= span.ttft_ms <= span.e2e_ms
    assert span.e2e_ms == pytest.approx(span.end_unix_ms - span.start_unix_ms, abs=50)
    # Same machine, same wall clock: the request arrived after it was sent, and soon after.
    assert exchange.sent_unix_ms - 5 <= span.start_unix_ms <= exchange.sent_unix_ms + exchange.client_ttft_ms
    # Asked again, it is found at once among the spans kept.
    assert vllm.thread.call(vllm.receiver.wait_for(exchange.request_id, 0)) == span


def test_metrics_samples_around_the_request(exchange):
    before, during, after = exchange.before, exchange.during, exchange.after
    assert exchange.during_arrived_before_end, "the mid-stream /metrics poll came back after the stream ended"
    assert (during.running, during.waiting) == (1, 0)
    assert (after.running, after.waiting) == (0, 0)
    assert during.source == "vLLM /metrics" and during.poll_ms > 0
    # A fraction of the cache's blocks (less vLLM's null block), not a percent.
    blocks = int(exchange.cache_config["num_gpu_blocks"]) - 1
    block_size = int(exchange.cache_config["block_size"])
    held = during.kv_usage * blocks
    assert held == pytest.approx(round(held), abs=1e-6)
    prompt = exchange.usage["prompt_tokens"]
    assert math.ceil(prompt / block_size) <= round(held) <= math.ceil((prompt + MAX_TOKENS) / block_size)
    assert 0 < during.kv_usage < 1 and after.kv_usage == 0
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt
    assert after.prefix_queries_total - before.prefix_queries_total == prompt
    assert after.prefix_hits_total >= before.prefix_hits_total
    assert after.preemptions_total == before.preemptions_total == 0


def test_tokenize_gives_the_prompt_the_request_used(vllm, exchange):
    async def both():
        async with aiohttp.ClientSession() as session:
            prompt = await vllm_prompt(session, vllm.root, MODEL, MESSAGES, {})
            with pytest.raises(ServerPromptError, match="HTTP 404.*does not exist"):
                await vllm_prompt(session, vllm.root, "no-such-model", MESSAGES, {})
            return prompt

    prompt = asyncio.run(both())
    assert prompt.token_ids == prompt_token_ids(exchange.chunks[0])
    assert len(prompt.token_ids) == exchange.usage["prompt_tokens"]
    assert len(prompt.pieces) == len(prompt.token_ids)
    assert prompt.pieces[:2] == ("<|im_start|>", "system")  # the template's default system turn
    assert prompt.source == "vLLM /tokenize (messages)"
