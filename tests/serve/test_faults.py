"""Faults and load against `reqscope serve` on loopback, each case bounded in time.

Concurrent streams beyond the queue (200, 429, 503), clients that leave mid-stream or while
queued, connections that stall in their headers, their body or idle, hostile bodies, non-JSON
content types, an empty API key, key guessing, the connection cap; then the server must still
answer normally with as many threads and file descriptors as before. The timeouts are set to
fractions of a second so a stall is seen to end quickly; the server's defaults are longer.

What the suite observes (accepted, rejected, cancelled, seconds to close a stalled socket...)
is collected in OBSERVED and printed by the last test; run with `-s` to see it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import pytest
from serve_harness import (
    KEY,
    MODEL,
    authorized,
    chat_body,
    first_texts,
    one_running,
    raw_request,
    serving,
    sse_payloads,
    wait_for_waiting,
)

from reqscope.cli import main
from reqscope.serve.connections import ConnectionLimits
from reqscope.serve.gateway import GatewayConfig, RateLimiter, retry_error

LIMITS = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=1.0, max_connections=12)
SLACK_S = 1.5  # scheduling noise allowed on a busy 2-core machine, on top of a configured timeout
LONG = 1500  # tokens: far more than any case waits for, so the request is still decoding
OBSERVED: dict[str, object] = {}


@dataclass(frozen=True)
class Resources:
    """What a leak would show: live threads and open file descriptors of this process."""

    threads: int
    fds: int


def _resources() -> Resources:
    return Resources(threading.active_count(), len(os.listdir("/proc/self/fd")))


def _settled(served, timeout_s: float = 10.0) -> Resources:
    """Resources once no request is running or waiting and the worker threads have ended."""
    deadline = time.monotonic() + timeout_s
    scheduler = served.engine.scheduler
    while time.monotonic() < deadline:
        workers = [t for t in threading.enumerate() if t.name.startswith("reqscope-") and t.name != "reqscope-serve"]
        if not workers and scheduler.running == 0 and scheduler.waiting == 0:
            break
        time.sleep(0.02)
    return _resources()


@pytest.fixture(scope="module")
def served(engine):
    """The server most cases share: a key, a queue of 2 and fast timeouts; its baseline resources."""
    gateway = GatewayConfig(api_keys=frozenset({KEY}))
    with one_running(engine), serving(engine, gateway, max_queue=2, limits=LIMITS) as s:
        warm = raw_request(s.url, "POST", "/v1/chat/completions", chat_body(max_tokens=2), authorized())
        assert warm.status == 200
        OBSERVED["baseline"] = _settled(s)
        yield s


def _address(served) -> tuple[str, int]:
    parts = urlsplit(served.url)
    return parts.hostname, parts.port


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    data = b""
    while True:
        left = limit_s - (time.monotonic() - start)
        assert left > 0, f"the server kept the connection open for more than {limit_s} s"
        ready, _, _ = select.select([sock], [], [], left)
        if ready:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return data, time.monotonic() - start
            data += chunk


def _status_and_headers(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


# -- admission under load ------------------------------------------------------------------------


async def _stream(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, str], bytes]:
    body = chat_body(max_tokens=400, temperature=0, stream=True, stream_options={"include_usage": True})
    async with session.post(url, json=body, headers=authorized()) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()


def test_concurrent_streams_beyond_the_queue_are_200_429_or_503(engine):
    gateway = GatewayConfig(api_keys=frozenset({KEY}), rate_per_minute=6, rate_burst=8)
    with one_running(engine), serving(engine, gateway, max_queue=2, limits=LIMITS) as served:

        async def scenario():
            async with aiohttp.ClientSession() as session:
                url = served.v1 + "/chat/completions"
                return await asyncio.wait_for(asyncio.gather(*(_stream(session, url) for _ in range(10))), 60)

        start = time.monotonic()
        results = asyncio.run(scenario())
        elapsed = time.monotonic() - start
    by_status: dict[int, int] = {}
    for status, headers, body in results:
        by_status[status] = by_status.get(status, 0) + 1
        if status == 200:
            payloads = sse_payloads(body)
            assert payloads[-1] == "[DONE]"
            assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 400  # every stream ends with usage
        else:
            error = json.loads(body)["error"]
            assert headers["x-request-id"]
            assert (status, error["code"]) in {(429, "rate_limit_exceeded"), (503, "queue_full")}
            if status == 429:  # one request per 10 s refills; the message says the same as the header
                assert headers["retry-after"] == "10" and error["message"].endswith("retry in 10 s")
            else:
                assert headers["retry-after"] == "1"
    assert by_status.get(429) == 2  # the burst of 8 admits 8 of the 10 through the gateway
    assert by_status.get(200, 0) >= 3 and by_status.get(503, 0) >= 1  # one running, two queued, the rest refused
    assert sum(by_status.values()) == 10
    OBSERVED["concurrent streams (10)"] = {
        "accepted": by_status.get(200, 0),
        "429": by_status.get(429, 0),
        "503 queue_full": by_status.get(503, 0),
        "seconds": round(elapsed, 2),
    }


def test_clients_that_leave_mid_stream_or_while_queued_are_cancelled(served):
    url = served.v1 + "/chat/completions"

    async def scenario() -> float:
        async with aiohttp.ClientSession() as session:
            stream = chat_body(max_tokens=LONG, temperature=0, stream=True)
            running = await session.post(url, json=stream, headers=authorized({"x-request-id": "fault-running"}))
            await first_texts(running, 3)
            leaver = asyncio.create_task(
                session.post(url, json=chat_body(max_tokens=3), headers=authorized({"x-request-id": "fault-leaver"}))
            )
            follower = asyncio.create_task(
                session.post(url, json=stream, headers=authorized({"x-request-id": "fault-follower"}))
            )
            await wait_for_waiting(session, served.url, 2)
            await asyncio.sleep(0.3)
            leaver.cancel()  # its connection closes while it waits in the queue
            await wait_for_waiting(session, served.url, 1)
            left = time.monotonic()
            running.close()  # mid-stream: the slot frees and the follower runs
            async with await follower as resp:
                assert resp.status == 200
                await first_texts(resp, 2)
                resp.close()
            return left

    asyncio.run(asyncio.wait_for(scenario(), 30))
    records = {rid: served.telemetry.wait_for(rid) for rid in ("fault-running", "fault-leaver", "fault-follower")}
    assert all(r is not None and r.result.finish_reason == "cancelled" for r in records.values())
    leaver = records["fault-leaver"].record()
    assert leaver["finish_reason"] == "cancelled" and leaver["cancelled"] and leaver["error"] is None
    assert leaver["queue_wait_ms"] >= 250  # its real wait, not 0
    assert leaver["usage"]["completion_tokens"] == 0
    for rid in ("fault-running", "fault-follower"):
        assert records[rid].tokens_after_disconnect <= 1  # only the step already running
    after = _settled(served)
    assert served.engine.scheduler.held_bytes == 0 and after.threads == OBSERVED["baseline"].threads
    OBSERVED["cancelled"] = {
        "mid-stream": 2,
        "while queued": 1,
        "leaver queue_wait_ms": leaver["queue_wait_ms"],
        "tokens after disconnect": max(records[r].tokens_after_disconnect for r in ("fault-running", "fault-follower")),
    }


# -- stalled connections ---------------------------------------------------------------------------


def test_a_stalled_or_dribbled_head_is_answered_408_and_closed(served):
    timeouts_before = served.connections.stats.header_timeouts
    with socket.create_connection(_address(served), timeout=5) as stalled:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        raw, stalled_s = _read_until_closed(stalled, LIMITS.header_timeout_s + SLACK_S)
    status, headers, body = _status_and_headers(raw)
    assert status == 408 and headers["x-request-id"] and json.loads(body)["error"]["code"] == "request_timeout"

    with socket.create_connection(_address(served), timeout=5) as silent:
        raw, silent_s = _read_until_closed(silent, LIMITS.header_timeout_s + SLACK_S)
    assert raw == b""  # it never asked anything, so it is not answered

    # One header byte every 0.1 s keeps the connection busy but never finishes the head.
    with socket.create_connection(_address(served), timeout=5) as dribbler:
        start = time.monotonic()
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
        closed = False
        for byte in head:
            try:
                dribbler.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if select.select([dribbler], [], [], 0.1)[0]:
                break
            assert time.monotonic() - start < LIMITS.header_timeout_s + SLACK_S, "still open while dribbling"
        if not closed:
            raw, _ = _read_until_closed(dribbler, SLACK_S)
            assert raw.startswith(b"HTTP/1.1 408")
        dribbled_s = time.monotonic() - start
    for seconds in (stalled_s, silent_s, dribbled_s):
        assert LIMITS.header_timeout_s * 0.8 <= seconds <= LIMITS.header_timeout_s + SLACK_S
    assert served.connections.stats.header_timeouts - timeouts_before == 3
    OBSERVED["seconds to close (header timeout 0.5 s)"] = {
        "partial head": round(stalled_s, 3),
        "silent": round(silent_s, 3),
        "dribbled": round(dribbled_s, 3),
    }


def test_a_stalled_body_is_answered_408_and_closed(served):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\n"
    )
    seconds = {}
    for name, framing, partial in (
        ("content-length", "Content-Length: 100\r\n\r\n", b'{"model": '),
        ("chunked", "Transfer-Encoding: chunked\r\n\r\n", b'a\r\n{"model": \r\n'),
    ):
        with socket.create_connection(_address(served), timeout=5) as sock:
            sock.sendall((head + framing).encode() + partial)
            raw, seconds[name] = _read_until_closed(sock, LIMITS.body_timeout_s + SLACK_S)
        status, headers, body = _status_and_headers(raw)
        assert status == 408 and headers["x-request-id"] and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert LIMITS.body_timeout_s * 0.8 <= seconds[name] <= LIMITS.body_timeout_s + SLACK_S
    OBSERVED["seconds to close (body timeout 0.5 s)"] = {k: round(v, 3) for k, v in seconds.items()}


def test_an_idle_keepalive_connection_is_closed(served):
    with socket.create_connection(_address(served), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        raw = b""
        while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < int(
            _status_and_headers(raw)[1]["content-length"]
        ):
            raw += sock.recv(65536)
        status, headers, _ = _status_and_headers(raw)
        assert status == 200 and headers["x-request-id"]
        rest, idle_s = _read_until_closed(sock, LIMITS.keepalive_timeout_s + SLACK_S)
    assert rest == b"" and LIMITS.keepalive_timeout_s * 0.8 <= idle_s <= LIMITS.keepalive_timeout_s + SLACK_S
    OBSERVED["seconds to close (keep-alive timeout 1 s)"] = round(idle_s, 3)


def test_connections_over_the_cap_are_refused_503_and_closed(served):
    deadline = time.monotonic() + 5
    while served.connections.stats.open_now and time.monotonic() < deadline:
        time.sleep(0.02)
    idle = [socket.create_connection(_address(served), timeout=5) for _ in range(LIMITS.max_connections)]
    try:
        over = raw_request(served.url, "GET", "/health")
        assert over.status == 503 and over.headers["retry-after"] == "1" and over.headers["connection"] == "close"
        assert over.json()["error"]["code"] == "too_many_connections" and over.headers["x-request-id"]
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 5
    while served.connections.stats.open_now and time.monotonic() < deadline:
        time.sleep(0.02)
    assert raw_request(served.url, "GET", "/health").status == 200
    OBSERVED["connection cap"] = {"limit": LIMITS.max_connections, "peak open": served.connections.stats.peak_open}


# -- hostile bodies and the gateway ---------------------------------------------------------------

_CHAT = b'{"model": "chatty", "messages": [{"role": "user", "content": "hi"}]'
HOSTILE = {  # name -> (body, the param its 400 must name)
    "lone surrogate": (b'{"model": "chatty", "messages": [{"role": "user", "content": "a\\ud800"}]}',
                       "messages[0].content"),
    "nested 100,000 deep": (b'{"model": "chatty", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    "nested 40 deep": (_CHAT + b', "metadata": ' + b"[" * 40 + b"]" * 40 + b"}", "metadata" + "[0]" * 32),
    "4,400-digit integer": (_CHAT + b', "max_tokens": 1' + b"0" * 4399 + b"}", "max_tokens"),
    "NaN": (_CHAT + b', "temperature": NaN}', "body"),
    "invalid UTF-8": (b'{"model": "chatty\xff"}', "body"),
    "surrogate in a key": (_CHAT + b', "\\udfff": 1}', "body"),
}  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_bodies_are_400_naming_the_field(served, caplog, name):
    body, param = HOSTILE[name]
    with caplog.at_level(logging.ERROR):
        resp = raw_request(served.url, "POST", "/v1/chat/completions", body, authorized())
    assert resp.status == 400, (name, resp.body[:200])
    assert resp.headers["content-type"].startswith("application/json") and resp.headers["x-request-id"]
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, (name, error)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no traceback in the log
    OBSERVED.setdefault("hostile bodies -> 400", []).append(name)


def test_a_huge_model_name_is_not_echoed_in_full(served):
    resp = raw_request(
        served.url, "POST", "/v1/chat/completions", {**chat_body(), "model": "m" * 100_000}, authorized()
    )
    assert resp.status == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert len(resp.body) < 500 and "100002 characters" in resp.json()["error"]["message"]
    OBSERVED["404 body bytes for a 100k model name"] = len(resp.body)


def test_a_prompt_longer_than_the_context_is_400_naming_it(served):
    long_prompt = "hello " * 2500  # about 2,500 tokens; the model's context is 2,048
    for path, body, param in (
        ("/v1/chat/completions", chat_body(long_prompt, max_tokens=2), "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 2}, "prompt"),
    ):
        resp = raw_request(served.url, "POST", path, body, authorized())
        assert resp.status == 400 and resp.json()["error"]["param"] == param
        assert "context of 2048" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_a_body_not_declared_json_is_415(served, content_type):
    body = json.dumps(chat_body(max_tokens=2)).encode()
    resp = raw_request(served.url, "POST", "/v1/chat/completions", body, authorized(), content_type=content_type)
    assert resp.status == 415 and resp.json()["error"]["code"] == "unsupported_media_type"
    assert resp.headers["x-request-id"]


def test_json_with_a_charset_is_accepted(served):
    body = json.dumps(chat_body(max_tokens=2)).encode()
    resp = raw_request(
        served.url, "POST", "/v1/completions", body, authorized(), content_type="application/json; charset=utf-8"
    )
    assert resp.status == 400 and resp.json()["error"]["param"] == "prompt"  # past the type check, to the fields


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--api-key", ""], None, "--api-key is empty"),
        (["--api-key", "good", "--api-key", " "], None, "--api-key is empty"),
        (["--api-key", " key "], None, "spaces"),
        ([], "  ", "$REQSCOPE_API_KEY is empty"),
    ],
)
def test_an_empty_api_key_is_refused_in_one_line(monkeypatch, capsys, argv, env, says):
    if env is None:
        monkeypatch.delenv("REQSCOPE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("REQSCOPE_API_KEY", env)
    code = main(["serve", "--model", "/nonexistent", *argv])  # refused before any model is opened
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_wrong_keys_are_throttled_per_client(engine):
    gateway = GatewayConfig(api_keys=frozenset({KEY, "second-key"}), auth_failure_burst=5, auth_failures_per_minute=60)
    with serving(engine, gateway, limits=LIMITS) as served:

        async def guesses(count: int) -> list[tuple[int, str | None, str]]:
            async with aiohttp.ClientSession() as session:
                out = []
                for i in range(count):
                    headers = {"Authorization": f"Bearer guess-{i}-é"}  # non-ASCII: compared as bytes
                    async with session.get(served.v1 + "/models", headers=headers) as resp:
                        out.append((resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"]["code"]))
                return out

        first = asyncio.run(asyncio.wait_for(guesses(5), 30))
        assert [status for status, _, _ in first] == [401] * 5
        locked = raw_request(served.url, "GET", "/v1/models", headers=authorized())
        assert locked.status == 429  # once locked, a right key fares no better: nothing to learn
        start = time.monotonic()
        flood = asyncio.run(asyncio.wait_for(guesses(195), 30))
        guessing_s = time.monotonic() - start
        statuses = [status for status, _, _ in first + flood]
        # One more failure is allowed per second (60 a minute); everything else is refused unchecked.
        assert statuses.count(401) <= 5 + int(guessing_s) + 1
        assert all(retry == "1" and code == "too_many_auth_failures" for status, retry, code in flood if status == 429)
        time.sleep(int(flood[-1][1] or 1) + 0.05)
        assert raw_request(served.url, "GET", "/v1/models", headers=authorized()).status == 200
    OBSERVED["200 wrong keys"] = {
        "401": statuses.count(401),
        "429": statuses.count(429),
        "seconds": round(guessing_s, 2),
    }


def test_rate_limiter_drops_idle_full_buckets():
    now = [0.0]
    limiter = RateLimiter(per_minute=60, burst=2, clock=lambda: now[0])  # refills fully in 2 s
    for i in range(1000):
        limiter.acquire(f"client-{i}")
    assert len(limiter) == 1000
    now[0] += 1.0
    limiter.acquire("busy")
    limiter.acquire("busy")
    now[0] += 1.5  # the others are full again; "busy" is not
    limiter.acquire("busy")
    assert len(limiter) == 1


def test_a_429_message_and_its_retry_after_agree():
    for wait_s, seconds in ((0.04, 1), (1.0, 1), (1.01, 2), (59.5, 60)):
        error = retry_error(wait_s, "rate limit reached", "rate_limit_exceeded")
        assert error.retry_after_s == seconds and error.message.endswith(f"retry in {seconds} s")


# -- afterwards ----------------------------------------------------------------------------------


def test_afterwards_the_server_answers_normally_with_flat_threads_and_fds(served):
    for method, path, status in (("GET", "/health", 200), ("GET", "/v1/nothing", 404), ("DELETE", "/health", 405)):
        resp = raw_request(served.url, method, path, headers=authorized())
        assert resp.status == status and resp.headers["x-request-id"]
        assert resp.headers["content-type"].startswith("application/json")
    resp = raw_request(served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=4, temperature=0), authorized())
    assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 5
    while served.connections.stats.open_now and time.monotonic() < deadline:
        time.sleep(0.02)
    baseline, after = OBSERVED["baseline"], _settled(served)
    assert after.threads == baseline.threads
    assert after.fds <= baseline.fds + 2  # allow for a descriptor the test process itself opened meanwhile
    OBSERVED["resources"] = {"baseline": baseline, "after": after, "connections": served.connections.stats}
    print("\nfault suite observed:")
    for key, value in OBSERVED.items():
        print(f"  {key}: {value}")
