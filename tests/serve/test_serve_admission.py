"""Admission and cancellation in `reqscope serve`: the bounded queue (503), queue wait inside TTFT,
and a client that disconnects mid-stream stopping decode within one step."""

from __future__ import annotations

import asyncio

import aiohttp
from serve_harness import authorized, chat_body, first_texts, one_running, serving, wait_for_waiting

LONG = 1500  # tokens: far more than the tests wait for, so the request is still decoding


def test_disconnect_mid_stream_cancels_decoding_within_one_step(engine):
    with serving(engine) as served:

        async def scenario() -> str:
            async with aiohttp.ClientSession() as session:
                body = chat_body(max_tokens=LONG, temperature=0, stream=True)
                resp = await session.post(served.v1 + "/chat/completions", json=body, headers=authorized())
                assert resp.status == 200
                await first_texts(resp, 3)
                resp.close()  # drop the connection mid-stream
                return resp.headers["x-request-id"]

        request_id = asyncio.run(scenario())
        served_request = served.telemetry.wait_for(request_id)
        record = served_request.record()
        assert record["finish_reason"] == "cancelled" and record["cancelled"] is True
        assert record["client_disconnected_ms"] is not None
        assert served_request.tokens_after_disconnect <= 1  # only the step already running
        assert 3 <= record["usage"]["completion_tokens"] < LONG
        assert engine.scheduler.running == 0 and engine.scheduler.held_bytes == 0  # slot and KV released


def test_full_queue_is_503_and_the_queued_wait_is_inside_ttft(engine):
    with one_running(engine), serving(engine, max_queue=1) as served:

        async def scenario() -> tuple[aiohttp.ClientResponse, dict, str]:
            async with aiohttp.ClientSession() as session:
                url = served.v1 + "/chat/completions"
                body = chat_body(max_tokens=LONG, temperature=0, stream=True)
                running = await session.post(url, json=body, headers=authorized())
                await first_texts(running, 1)  # decoding: it holds the only running slot
                queued = asyncio.create_task(
                    session.post(url, json=chat_body(max_tokens=3, temperature=0), headers=authorized())
                )
                await wait_for_waiting(session, served.url, 1)
                async with session.post(url, json=chat_body(max_tokens=3), headers=authorized()) as refused:
                    refused_body = await refused.json()
                    assert refused.status == 503 and refused.headers["retry-after"] == "1"
                await asyncio.sleep(0.3)  # the queued request keeps waiting meanwhile
                running.close()  # its client goes away: the slot frees, the queued one runs
                async with await queued as resp:
                    assert resp.status == 200
                    return refused_body, await resp.json(), running.headers["x-request-id"]

        refused_body, answer, running_id = asyncio.run(scenario())
        assert refused_body["error"]["code"] == "queue_full"
        assert "queue is full" in refused_body["error"]["message"]
        report = answer["reqscope"]
        assert report["queue_wait_ms"] >= 300
        assert report["stages_ms"]["admit"] >= report["queue_wait_ms"]  # admit stage holds the wait
        assert report["ttft_ms"] > report["queue_wait_ms"] + report["stages_ms"]["prefill"]
        assert answer["usage"]["completion_tokens"] == 3
        assert served.telemetry.wait_for(running_id).result.finish_reason == "cancelled"
