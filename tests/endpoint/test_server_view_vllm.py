"""The endpoint client's view of a request inside a real vLLM (0.32, CPU build), end to end.

Against the session's vLLM (conftest.py: per-request metrics, prompt token details and its trace
exporter on), the client must hold vLLM's own view beside its own: the per-request metrics and
the span reconciled with the client's TTFT, the batch polled while the request runs, the
template's tokens checked against the usage, an ITL spike marked with the long prompt that caused
it, and one line for each view left off. Through `--json`, `--plain` and the explorer.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from peers import vllm_python
from ui_fixtures import panel_text, wait_for

from minengine.engine.request import GenerationRequest
from reqscope.cli import main
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.events import ChunkReceived, StreamEnded
from reqscope.endpoint.server.reconcile import spike_marks
from reqscope.endpoint.server.words import split_parts
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.ui.endpoint.app import EndpointApp

if vllm_python() is None:
    pytest.skip("vLLM is not provisioned: run scripts/peers/vllm", allow_module_level=True)

PROMPT = "Write a long story about a dragon who learns to bake bread."


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_json_carries_vllms_view_reconciled_with_the_clients(vllm_server, capsys):
    listen = f"127.0.0.1:{vllm_server.otlp_port}"
    code = main(["--base-url", vllm_server.v1, "--json", "--otlp-listen", listen, "--poll-ms", "100",
                 "--max-tokens", "64", "--temperature", "0", PROMPT])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    records = _records(captured.out)
    done = next(r for r in records if r["event"] == "done")
    view = done["server_view"]
    assert view["server"]["name"] == "vllm" and view["server"]["version"] == "0.32.0"
    assert view["off"] == []  # every view is on: per-request metrics, prompt details, the span
    # The batch, polled while the request ran: vLLM saw this request running.
    batch = [r for r in records if r["event"] == "batch"]
    assert len(batch) >= 2 and all(r["source"] == "vLLM /metrics" for r in batch)
    assert max(r["running"] for r in batch) >= 1 and view["batch_polls"]["count"] == len(batch)
    # vLLM's metrics split the client's TTFT; connection and delivery are one figure without a clock.
    metrics, split = view["vllm_metrics"], view["ttft_split"]
    assert split["joined"] and split["source"] == "vLLM per-request metrics"
    assert split["client_ttft_ms"] == pytest.approx(done["metrics"]["ttft_ms"])
    server_ms = metrics["queue_time_ms"] + metrics["time_to_first_token_ms"]
    assert split["outside_ms"] == pytest.approx(split["client_ttft_ms"] - server_ms) and split["outside_ms"] > 0
    # The server's tokens: its template, as /tokenize and the request itself returned them.
    prompt_tokens = done["usage"]["prompt_tokens"]
    assert len(view["prompt"]["token_ids"]) == prompt_tokens == len(view["prompt_token_ids_returned"])
    assert view["prompt"]["token_ids"] == view["prompt_token_ids_returned"]
    # The span came after `done`, matched by the id the client sent, and places the server on the wall clock.
    span_record = next(r for r in records if r["event"] == "server_span")
    span, placed = span_record["span"], span_record["ttft_split"]
    assert span["request_id"] == f"chatcmpl-{view['request_id_sent']}"
    assert (span["prompt_tokens"], span["completion_tokens"]) == (prompt_tokens, done["usage"]["completion_tokens"])
    assert not placed["joined"] and placed["clock_note"] is None and placed["source"].startswith("vLLM span")
    parts = (placed["connection_http_ms"], placed["queue_ms"], placed["prefill_first_token_ms"], placed["delivery_ms"])
    assert sum(parts) == pytest.approx(placed["client_ttft_ms"], abs=0.01)
    assert all(part >= -2.0 for part in parts)  # one machine, one clock: no part runs backwards


def test_plain_names_each_view_that_is_off_and_checks_the_tokens(vllm_server, capsys):
    code = main(["--base-url", vllm_server.v1, "--plain", "--max-tokens", "16", "--temperature", "0", "Hi"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "server    vllm 0.32.0 at " in err
    assert "TTFT " in err and "from vLLM per-request metrics (connection, HTTP and delivery together" in err
    off = "off       vLLM's trace span (queue, prefill, decode on its clock): off; run reqscope with --otlp-listen"
    assert off in err
    prompt = next(line for line in err.splitlines() if line.startswith("prompt    "))
    count = int(prompt.split()[1])
    assert f"= usage.prompt_tokens {count} ✓, the same ids the request returned (vLLM /tokenize (messages))" in prompt
    assert "batch     running 0→0" in err or "batch     running 1→" in err or "batch     running 0→1" in err


async def _long_prompt(root: str) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 1}
    async with aiohttp.ClientSession() as session, session.post(root + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def test_an_itl_spike_is_marked_with_the_long_prompt_that_arrived(vllm_server):
    async def run() -> tuple[list[float], tuple]:
        request = GenerationRequest.from_prompt(PROMPT)
        settings = RequestSettings(temperature=0, max_tokens=240)
        times: list[float] = []
        other: asyncio.Task | None = None
        async with EndpointClient(vllm_server.v1, poll_ms=100) as client:
            async for event in client.stream_chat(request, "smollm2", settings):
                if isinstance(event, ChunkReceived):
                    times.append(event.t_ms)
                    if event.index == 20:  # mid-stream: another client's 3,000-token prompt arrives
                        other = asyncio.create_task(_long_prompt(vllm_server.root))
                elif isinstance(event, StreamEnded):
                    assert event.result.error is None, event.result.error
                    batch = event.result.server_view.batch
        assert other is not None, f"the stream ended after {len(times)} chunks, before the long prompt was sent"
        await other
        return times, batch

    times, batch = asyncio.run(run())
    marks = spike_marks(times, batch)
    assert marks, "no gap reached 3x the median ITL while vLLM prefilled 3,000 tokens"
    assert any("a long prompt arrived" in m.reason for m in marks), [m.reason for m in marks]


@pytest.mark.anyio
async def test_the_explorer_draws_vllms_batch_tokens_and_split(vllm_server):
    target = EndpointTarget(vllm_server.v1, poll_ms=100, otlp_listen=("127.0.0.1", vllm_server.otlp_port))
    app = EndpointApp(target, GenerationRequest.from_prompt("Hi"),
                      settings=RequestSettings(temperature=0, max_tokens=24))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.view.server is not None, timeout=40)
        await wait_for(pilot, lambda: not app.needs_repaint)
        if app.view.server.span is None:  # vLLM exports its spans in batches, seconds after the stream
            assert "vLLM's span: waiting for it" in panel_text(app, "#latency")
        await wait_for(pilot, lambda: app.view.server.span is not None, timeout=40)
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert app.query_one("#body").has_class("-server-strip")
        view = app.view.server
        latency, batch, template = (panel_text(app, f"#{name}").replace("\u00a0", " ")
                                    for name in ("latency", "batch", "template"))
        assert f"TTFT {view.ttft_split.client_ttft_ms:.1f} ms (client) split by the server: vLLM span" in latency
        named = [name for name, ms in split_parts(view.ttft_split) if ms is not None]
        assert all(name in latency for name in named) and "vLLM per-request metrics" in latency
        assert "vLLM /metrics every 100 ms" in batch and "running" in batch
        assert f"= usage.prompt_tokens {app.view.result.usage.prompt_tokens} ✓" in template



@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _background_load(root: str, stop: asyncio.Event, clients: int = 3) -> None:
    """Other clients' streamed requests, a new one as each ends, until `stop`."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48,
            "stream": True}

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.post(root + "/v1/chat/completions", json=body) as resp:
                async for _ in resp.content:
                    pass

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(clients)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.anyio
@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_under_another_clients_load_the_explorer_shows_vllms_side_at_small_sizes(vllm_server, size):
    stop = asyncio.Event()
    load = asyncio.create_task(_background_load(vllm_server.root, stop))
    target = EndpointTarget(vllm_server.v1, poll_ms=100, otlp_listen=("127.0.0.1", vllm_server.otlp_port))
    app = EndpointApp(target, GenerationRequest.from_prompt("Hi"),
                      settings=RequestSettings(temperature=0, max_tokens=48))
    try:
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: app.view.server is not None, timeout=60)
            stop.set()
            await pilot.press("3")  # the latency panel: the client's TTFT, split by vLLM's queue and prefill
            await wait_for(pilot, lambda: not app.needs_repaint)
            split = app.view.server.ttft_split
            latency = panel_text(app, "#latency").replace("\u00a0", " ")
            assert f"TTFT {split.client_ttft_ms:.1f} ms (client) split by the server" in latency
            assert f"queue {split.queue_ms:.1f}" in latency
            assert f"prefill + first token {split.prefill_first_token_ms:.1f}" in latency
            await pilot.press("6")  # the batch: vLLM's running and waiting, its KV use across the request
            await wait_for(pilot, lambda: not app.needs_repaint)
            batch = panel_text(app, "#batch")
            peak = max(s.running for s in app.view.batch)
            assert peak >= 2, "the other clients' requests never ran beside this one"
            assert f"running at most {peak:.0f}" in batch and "KV %" in batch and "now: running" in batch
            await wait_for(pilot, lambda: app.view.server.span is not None, timeout=40)
            await pilot.press("3")
            await wait_for(pilot, lambda: not app.needs_repaint)
            assert "split by the server: vLLM span" in panel_text(app, "#latency")
    finally:
        stop.set()
        await load
