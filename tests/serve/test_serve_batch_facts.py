"""serve's batch facts: each response's `reqscope` report and telemetry record carry the request's
`BatchSummary`, and /metrics counts preemptions as they happen (vLLM's num_preemptions_total)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from serve_harness import (
    authorized,
    chat_body,
    first_texts,
    one,
    raw_request,
    scrape,
    serving,
    sse_payloads,
    wait_for_waiting,
)

from minengine.engine.batch_facts import BatchStep, BatchSummary, PreemptEvent
from minengine.engine.events import TokenEvent
from minengine.kv.usage import PoolUsage
from reqscope.serve.telemetry import batch_json

CHAT = "/v1/chat/completions"
LONG = 1500  # tokens: far more than the tests wait for, so every stream is still decoding


def _step(step: int, sequences: int) -> BatchStep:
    return BatchStep(step, sequences, sequences, 0, 0, 1.0, 0.5, PoolUsage(100, 10, 20, 30))


def test_batch_json_is_the_summary_with_the_mean_rounded():
    summary = BatchSummary.of([_step(1, 1), _step(2, 3), _step(3, 3)], prefill_chunks=2, preemptions=1)
    assert batch_json(summary) == {
        "steps": 3,
        "shared_steps": 2,
        "mean_batch": 2.333,
        "max_batch": 3,
        "prefill_chunks": 2,
        "preemptions": 1,
    }
    assert batch_json(None) is None


def test_the_report_and_the_telemetry_record_carry_the_requests_batch_summary(engine):
    with serving(engine) as served:
        body = chat_body(max_tokens=5, temperature=0, stream=True)
        resp = raw_request(served.url, "POST", CHAT, body, authorized())
        assert resp.status == 200, resp.body
        finish = json.loads(sse_payloads(resp.body)[-2])
        whole = raw_request(served.url, "POST", CHAT, chat_body(max_tokens=5, temperature=0), authorized())
        assert whole.status == 200, whole.body
    for report, request_id in ((finish["reqscope"], resp.headers["x-request-id"]),
                               (whole.json()["reqscope"], whole.headers["x-request-id"])):  # fmt: skip
        served_request = served.telemetry.wait_for(request_id)
        batch = served_request.result.batch
        # Alone: a prefill step (its prompt fits one chunk of the budget), then 4 decode steps.
        assert (batch.steps, batch.shared_steps, batch.max_batch, batch.prefill_chunks) == (5, 0, 1, 1)
        assert report["batch"] == batch_json(batch) == served_request.record()["batch"]


class _Preempted:
    """A real session whose events gain `count` preemptions before its second token (as the step
    loop emits them: in the request's stream, between its tokens)."""

    def __init__(self, session, count: int) -> None:
        self._session = session
        self._count = count

    def __getattr__(self, name: str):
        return getattr(self._session, name)

    def __iter__(self):
        tokens = 0
        for event in self._session:
            if isinstance(event, TokenEvent):
                tokens += 1
                if tokens == 2:
                    for _ in range(self._count):
                        yield PreemptEvent("the pool ran out of blocks", 2, 4096, 7, event.t_ms)
            yield event


def test_preemptions_are_counted_in_metrics_as_they_happen(engine, monkeypatch):
    start = engine.start
    monkeypatch.setattr(engine, "start", lambda req, timeline=None, **kw: _Preempted(start(req, timeline, **kw), 2))
    with serving(engine) as served:
        assert one(scrape(served), "reqscope:num_preemptions_total") == 0  # the series exists from the start
        resp = raw_request(served.url, "POST", CHAT, chat_body(max_tokens=4, temperature=0, stream=True), authorized())
        assert resp.status == 200 and sse_payloads(resp.body)[-1] == "[DONE]"
        assert served.telemetry.wait_for(resp.headers["x-request-id"]) is not None
        assert one(scrape(served), "reqscope:num_preemptions_total") == 2


def test_num_requests_running_is_every_request_in_the_batch(engine):
    streams = 3

    async def scenario(served) -> tuple[dict, int]:
        async with aiohttp.ClientSession() as session:
            url = served.v1 + "/chat/completions"
            body = chat_body(max_tokens=LONG, temperature=0, ignore_eos=True, stream=True)
            posts = [asyncio.create_task(session.post(url, json=body, headers=authorized())) for _ in range(streams)]
            admitted = []
            for post in asyncio.as_completed(posts):  # a stream's status comes once it is admitted
                admitted.append(resp := await post)
                await first_texts(resp, 1)
                if len(admitted) == min(streams, engine.scheduler.max_running):
                    break
            await wait_for_waiting(session, served.url, streams - len(admitted))
            samples = await asyncio.to_thread(scrape, served)
            held = engine.scheduler.held_bytes  # constant while the same requests run
            for post in posts:
                post.cancel()
            for resp in admitted:
                resp.close()
            return samples, held

    with serving(engine) as served:
        samples, held = asyncio.run(scenario(served))
    batch = min(streams, engine.scheduler.max_running)
    assert one(samples, "reqscope:num_requests_running") == batch
    assert one(samples, "reqscope:num_requests_waiting") == streams - batch
    # The KV the whole batch holds, read as the scrape read it.
    assert held > 0
    assert one(samples, "reqscope:kv_cache_usage_perc") == pytest.approx(held / engine.scheduler.kv_budget_bytes)
