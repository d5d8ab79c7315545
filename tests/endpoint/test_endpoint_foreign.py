"""The client against a server that is not reqscope's: what it sends, and reading llama.cpp's `timings`.

The server here is a few lines of aiohttp on 127.0.0.1 that records every request body it is
sent and streams back a fixed answer shaped like llama.cpp's server (llama-server): one token
per chunk, then a last chunk with the finish reason, `usage` and a `timings` object.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from minengine.engine.request import GenerationRequest
from reqscope.cli import main
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.events import ServerTimings, StreamEnded
from reqscope.endpoint.settings import RequestSettings, token_limit_field
from reqscope.endpoint.wire import chat_body, parse_chunk
from reqscope.serve.runner import start_in_thread

MODEL = "llama-like"
WORDS = ("Hello", " from", " llama")
TIMINGS = {
    "cache_n": 2,
    "prompt_n": 9,
    "prompt_ms": 12.5,
    "prompt_per_token_ms": 1.3888,
    "prompt_per_second": 720.0,
    "predicted_n": 3,
    "predicted_ms": 34.5,
    "predicted_per_token_ms": 11.5,
    "predicted_per_second": 86.96,
}
# What every body carries whatever the flags: the rest is only what the user set.
ALWAYS = {"model", "messages", "stream", "stream_options"}


@dataclass
class Foreign:
    """The running server: its base URL and the JSON bodies of the requests it received."""

    v1: str
    bodies: list[dict] = field(default_factory=list)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _app(bodies: list[dict]) -> web.Application:
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in WORDS:
            await asyncio.sleep(0.01)
            await response.write(_sse({"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}))
        await response.write(_sse({
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
            "timings": TIMINGS,
        }))
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture
def foreign() -> Iterator[Foreign]:
    bodies: list[dict] = []
    server = start_in_thread(_app(bodies), "127.0.0.1", 0)
    try:
        yield Foreign(server.url + "/v1", bodies)
    finally:
        server.stop()


def _sent(foreign: Foreign, *flags: str) -> dict:
    """Run the CLI in plain mode with `flags`; the body the server received."""
    assert main(["--base-url", foreign.v1, "--plain", *flags, "hi"]) == 0
    assert len(foreign.bodies) == 1
    return foreign.bodies[0]


def test_a_default_run_sends_no_sampling_and_no_logprobs(foreign, capsys):
    body = _sent(foreign)
    assert set(body) == ALWAYS
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    err = capsys.readouterr().err
    sent = "· sent      server default for all (temperature, top_k, top_p, min_p, seed, max_tokens); logprobs off"
    assert sent in err
    assert "asking for logprobs" not in err  # nothing asked, nothing to warn about


def test_only_the_flags_given_are_sent(foreign, capsys):
    body = _sent(foreign, "--temperature", "0", "--max-tokens", "5", "--top-p", "0.5")
    assert set(body) - ALWAYS == {"temperature", "max_tokens", "top_p"}
    assert (body["temperature"], body["max_tokens"], body["top_p"]) == (0.0, 5, 0.5)
    err = capsys.readouterr().err
    assert "· sent      temperature 0, top_p 0.5, max_tokens 5; server default: top_k, min_p, seed; logprobs off" in err


def test_top_k_min_p_and_seed_go_only_when_given(foreign):
    body = _sent(foreign, "--top-k", "0", "--min-p", "0.05", "--seed", "7")
    assert set(body) - ALWAYS == {"top_k", "min_p", "seed"}  # --top-k 0 is sent as given: the user said it
    assert (body["top_k"], body["min_p"], body["seed"]) == (0, 0.05, 7)


def test_logprobs_3_asks_for_three_alternatives_and_says_what_it_costs(foreign, capsys):
    body = _sent(foreign, "--logprobs", "3")
    assert set(body) - ALWAYS == {"logprobs", "top_logprobs"}
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    err = capsys.readouterr().err
    assert "logprobs on (top 3 per token)" in err
    assert "logprobs  on (top 3 per token), none returned: asking for logprobs can slow the server" in err
    assert "run with --no-logprobs to compare" in err


def test_logprobs_0_asks_for_the_chosen_tokens_only(foreign):
    body = _sent(foreign, "--logprobs", "0")
    # top_logprobs goes even as 0: llama.cpp's server reads a missing one as 20 alternatives.
    assert body["logprobs"] is True and body["top_logprobs"] == 0


def test_no_logprobs_leaves_them_out(foreign):
    body = _sent(foreign, "--logprobs", "3", "--no-logprobs")
    assert "logprobs" not in body and "top_logprobs" not in body


def test_openais_host_gets_max_completion_tokens():
    # The body builder only: no test contacts the internet.
    request = GenerationRequest.from_prompt("hi")
    settings = RequestSettings(max_tokens=64, temperature=0.2)
    assert token_limit_field("https://api.openai.com/v1") == "max_completion_tokens"
    body = chat_body(request, "gpt-4o-mini", settings, token_limit_field("https://api.openai.com/v1"))
    assert body["max_completion_tokens"] == 64 and "max_tokens" not in body
    assert "top_k" not in body and "min_p" not in body and "logprobs" not in body
    for url in ("http://127.0.0.1:8000/v1", "http://localhost:8080/v1", "https://api.openai.com.example.net/v1"):
        assert token_limit_field(url) == "max_tokens"
        assert chat_body(request, "m", settings, token_limit_field(url))["max_tokens"] == 64


def test_the_servers_timings_are_read():
    async def collect(v1: str):
        async with EndpointClient(v1) as client:
            return [e async for e in client.stream_chat(GenerationRequest.from_prompt("hi"), MODEL)]

    bodies: list[dict] = []
    server = start_in_thread(_app(bodies), "127.0.0.1", 0)
    try:
        events = asyncio.run(collect(server.url + "/v1"))
    finally:
        server.stop()
    assert isinstance(events[-1], StreamEnded)
    result = events[-1].result
    assert result.error is None and result.text == "".join(WORDS)
    assert result.timings == ServerTimings(
        prompt_n=9, prompt_ms=12.5, prompt_per_second=720.0, predicted_n=3, predicted_ms=34.5,
        predicted_per_token_ms=11.5, predicted_per_second=86.96, cache_n=2,
    )
    assert result.server is None and result.ttft is None  # no reqscope report, so no server TTFT
    m = result.metrics
    assert result.tpot is not None and result.tpot.source == "timings"
    assert result.tpot.client_ms == pytest.approx(m.tpot_ms) and result.tpot.server_ms == 11.5


def test_timings_are_shown_as_the_servers_view_in_plain_mode(foreign, capsys):
    _sent(foreign)
    err = capsys.readouterr().err
    assert (
        "server    llama.cpp timings, on its clock: prompt 9 tokens in 12.50 ms (+2 from its cache); "
        "generated 3 tokens in 34.50 ms, 11.50 ms/token (86.96 tokens/s)"
    ) in err
    assert "beyond the server's prompt time" in err
    assert "TPOT 11.50 ms/token on its clock (its timings); client TPOT" in err


def test_timings_and_settings_in_json_mode(foreign, capsys):
    assert main(["--base-url", foreign.v1, "--json", "--max-tokens", "8", "--logprobs", "2", "hi"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    sent, done = records[0], records[-1]
    assert sent["event"] == "sent" and sent["sampling"] == {"max_tokens": 8}
    assert sent["server_default"] == ["temperature", "top_k", "top_p", "min_p", "seed"]
    assert sent["logprobs"]["top_logprobs"] == 2 and "can slow the server" in sent["logprobs"]["note"]
    assert done["event"] == "done"
    assert done["server_timings"]["predicted_per_token_ms"] == 11.5 and done["server_timings"]["cache_n"] == 2
    t = done["tpot_comparison"]
    assert t["source"] == "timings" and t["server_ms"] == 11.5
    assert t["client_ms"] == pytest.approx(done["metrics"]["tpot_ms"])
    assert t["outside_server_ms"] == pytest.approx(t["client_ms"] - 11.5)
    assert done["logprobs"]["tokens"] == 0  # asked for, but this server returns none
    assert done["server"] is None and done["ttft_comparison"] is None


def test_a_json_run_without_logprobs_says_none_were_asked(foreign, capsys):
    assert main(["--base-url", foreign.v1, "--json", "hi"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["sampling"] == {} and records[0]["logprobs"] is None
    assert len(records[0]["server_default"]) == 6 and records[-1]["logprobs"] is None


def test_timings_in_any_chunk_are_read_and_a_chunk_without_them_is_left_alone():
    chunk = parse_chunk(json.dumps({"choices": [], "timings": {"prompt_ms": 1.0, "predicted_n": True}}))
    assert chunk.timings is not None and chunk.timings.prompt_ms == 1.0
    assert chunk.timings.predicted_n is None  # a bool is not a count
    assert parse_chunk(json.dumps({"choices": [], "timings": {"n": 1}})).timings is None  # no times in it
    assert parse_chunk(json.dumps({"choices": []})).timings is None
