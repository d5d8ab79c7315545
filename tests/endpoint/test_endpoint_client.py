"""The endpoint client against `reqscope serve`: its timeline and metrics beside the server's own."""

from __future__ import annotations

import asyncio
import json

import pytest
from serve_harness import KEY, MODEL, serving

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from reqscope.cli import main
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.events import ChunkReceived, ConnectionReady, RequestSent, ResponseStarted, StreamEnded
from reqscope.endpoint.settings import RequestSettings

TOKENS = 10
REQUEST = GenerationRequest.from_prompt("Hello there")
SETTINGS = RequestSettings(temperature=0, max_tokens=TOKENS, top_logprobs=2)


@pytest.fixture(scope="module")
def served(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)
    with serving(engine) as s:
        yield s


def _stream(served, new_connection: bool = False, api_key: str = KEY) -> list:
    async def collect():
        async with EndpointClient(served.v1, api_key=api_key, new_connection=new_connection) as c:
            assert await c.models() == (MODEL,)  # also opens the connection the request may reuse
            return [e async for e in c.stream_chat(REQUEST, MODEL, SETTINGS)]

    return asyncio.run(collect())


def test_client_metrics_against_the_servers_own_timeline(served):
    events = _stream(served)
    assert [type(e) for e in events[:3]] == [RequestSent, ConnectionReady, ResponseStarted]
    assert isinstance(events[-1], StreamEnded)
    result = events[-1].result
    chunks = [e for e in events if isinstance(e, ChunkReceived)]
    server = served.telemetry.wait_for(result.request_id).result

    assert result.error is None and result.status == 200 and result.finish_reason == "length"
    assert result.text == server.text
    assert (result.output_tokens, result.output_tokens_source) == (TOKENS, "usage")
    assert sum(len(c.logprobs) for c in chunks) == TOKENS  # one logprob entry per token
    m, sm = result.metrics, server.metrics
    assert m.itl.count == len(chunks) - 1
    assert m.tpot_ms == pytest.approx((m.e2e_ms - m.ttft_ms) / (TOKENS - 1))
    # The client's clock starts before the server's and stops after it: it sees more, never less.
    assert m.ttft_ms >= sm.ttft_ms and m.e2e_ms >= sm.e2e_ms
    assert m.ttft_ms - sm.ttft_ms < 500  # loopback: network and HTTP cost little
    comparison = result.ttft
    assert comparison.server_ms == pytest.approx(sm.ttft_ms)
    assert comparison.outside_server_ms == pytest.approx(m.ttft_ms - sm.ttft_ms)
    gateway_ms = next(s.duration_ms for s in server.stages if s.name == "gateway")
    assert comparison.gateway_ms == pytest.approx(gateway_ms, abs=1e-3)  # the report rounds to microseconds
    assert result.server.output_tokens == sm.output_tokens
    names = [e.name for e in result.timeline]
    for earlier, later in [("client_send", "first_byte"), ("first_byte", "first_visible_token")]:
        assert names.index(earlier) < names.index(later)
    assert names.count("token") == len(chunks) and names[-1] == "completed"


def test_connection_is_reused_unless_a_new_one_is_asked_for(served):
    reused = next(e for e in _stream(served) if isinstance(e, ConnectionReady))
    fresh = next(e for e in _stream(served, new_connection=True) if isinstance(e, ConnectionReady))
    assert reused.reused and reused.connect_ms is None
    assert not fresh.reused and fresh.connect_ms is not None and fresh.connect_ms >= 0


def test_http_errors_end_the_stream_with_the_servers_message(served):
    async def collect():
        async with EndpointClient(served.v1, api_key="wrong") as c:
            return [e async for e in c.stream_chat(REQUEST, MODEL, SETTINGS)]

    result = asyncio.run(collect())[-1].result
    assert result.status == 401 and result.metrics is None
    assert result.error == "HTTP 401: incorrect API key"


def test_cli_endpoint_json_mode(served, capsys):
    code = main(["--base-url", served.v1, "--api-key", KEY, "--json", "--temperature", "0", "--max-tokens", "4", "hi"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [r["event"] for r in records[:3]] == ["sent", "connection", "response"]
    assert records[1]["reused"] is True  # the model list opened it
    done = records[-1]
    assert done["event"] == "done" and done["usage"]["completion_tokens"] == 4
    assert done["metrics"]["ttft_ms"] == pytest.approx(done["ttft_comparison"]["client_ms"])
    assert done["ttft_comparison"]["outside_server_ms"] >= 0
    assert done["server"]["request_id"] == done["request_id"]
    assert done["kv_planned"] is None


def test_cli_endpoint_plain_mode_with_planner_kv(served, capsys):
    argv = ["--base-url", served.v1, "--api-key", KEY, "--plain", "--new-connection"]
    argv += ["--card", "smollm2-135m-instruct", "--temperature", "0", "--max-tokens", "4", "hi"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "new connection, opened in" in err
    assert "outside the server" in err
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 2 bytes = 23,040 bytes = 22.5 KiB per token.
    assert "computed by the planner for smollm2-135m-instruct (bfloat16): 22.5 KiB/token" in err


def test_cli_endpoint_refused_key_is_a_one_line_error(served, capsys):
    assert main(["--base-url", served.v1, "--api-key", "wrong", "--plain", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"reqscope: error: {served.v1} refused the API key (incorrect API key); pass --api-key or set OPENAI_API_KEY"
    ]


def test_cli_default_run_sends_no_sampling_and_still_works(served, capsys):
    # Nothing set: the body carries no sampling and no logprobs, and reqscope serve applies its defaults.
    assert main(["--base-url", served.v1, "--api-key", KEY, "--json", "hi"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sent, done = records[0], records[-1]
    assert sent["sampling"] == {} and sent["logprobs"] is None
    assert sent["server_default"] == ["temperature", "top_k", "top_p", "min_p", "seed", "max_tokens"]
    assert done["event"] == "done" and done["finish_reason"] in ("stop", "length")
    assert 0 < done["usage"]["completion_tokens"] <= 256  # the server's default max_tokens
    assert all("logprobs" not in r for r in records if r["event"] == "chunk")  # none asked, none sent back
    assert done["logprobs"] is None
    record = served.telemetry.wait_for(done["request_id"]).record()
    assert record["usage"]["completion_tokens"] == done["usage"]["completion_tokens"]
    # The server's view beside the client's: its TTFT from its report, and its TPOT.
    assert done["server"]["request_id"] == done["request_id"]
    t = done["tpot_comparison"]
    if done["usage"]["completion_tokens"] > 1:
        assert t["source"] == "reqscope" and t["server_ms"] == pytest.approx(done["server"]["tpot_ms"])


def test_cli_plain_mode_shows_server_defaults_and_the_servers_tpot(served, capsys):
    argv = ["--base-url", served.v1, "--api-key", KEY, "--plain", "--temperature", "0", "--max-tokens", "4"]
    assert main([*argv, "--logprobs", "2", "hi"]) == 0
    err = capsys.readouterr().err
    sent = "· sent      temperature 0, max_tokens 4; server default: top_k, top_p, min_p, seed; logprobs on (top 2"
    assert sent in err
    assert "ms/token on its clock (its report); client TPOT" in err
    assert "logprobs  on (top 2 per token), returned for 4 tokens: asking for logprobs can slow the server" in err


def test_the_prefix_cache_hit_reported_by_the_server_reaches_the_client(served, capsys):
    long = GenerationRequest.from_prompt("Kyoto hotels with step-free rooms, near the station. " * 12)

    async def twice():
        async with EndpointClient(served.v1, api_key=KEY) as c:
            return [[e async for e in c.stream_chat(long, MODEL, SETTINGS)] for _ in range(2)]

    first, second = (events[-1].result for events in asyncio.run(twice()))
    cached = second.usage.cached_tokens  # the first may hit the chat template's opening blocks
    assert first.usage.cached_tokens < cached < second.usage.prompt_tokens  # never the last token
    assert cached == served.telemetry.wait_for(second.request_id).result.usage.cached_tokens

    argv = ["--base-url", served.v1, "--model", MODEL, "--api-key", KEY, "--plain", "--max-tokens", "2"]
    assert main([*argv, "--temperature", "0", long.messages[-1].content]) == 0
    assert f"({cached} cached)" in capsys.readouterr().err
