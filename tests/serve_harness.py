"""Helpers for the serving tests: `reqscope serve` on loopback over the chatty tiny model.

Every server listens on 127.0.0.1 on a free port; no test reaches any other address.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, RequestResult
from minengine.engine.request import GenerationRequest
from minengine.engine.step_loop import BatchLimits
from reqscope.serve.app import ServeConfig, build_app
from reqscope.serve.connections import CONNECTION_GUARD, ConnectionGuard
from reqscope.serve.gateway import GatewayConfig
from reqscope.serve.runner import start_in_thread
from reqscope.serve.telemetry import TelemetryLog

MODEL = "chatty"
KEY = "test-key"


@dataclass(frozen=True)
class Served:
    """A running server: its base URL (without /v1), its telemetry and its connection guard."""

    url: str
    telemetry: TelemetryLog
    engine: Engine
    connections: ConnectionGuard

    @property
    def v1(self) -> str:
        """The OpenAI base URL."""
        return self.url + "/v1"


@contextmanager
def one_running(engine: Engine) -> Iterator[None]:
    """Within the block, `engine` runs one request at a time (a server built inside admits one):
    for the cases about queueing, which need a request to wait behind a running one."""
    limits = engine.steps.limits
    engine.steps.set_limits(BatchLimits(max_num_seqs=1, max_num_batched_tokens=limits.max_num_batched_tokens))
    try:
        yield
    finally:
        engine.steps.set_limits(limits)


@contextmanager
def serving(engine: Engine, gateway: GatewayConfig | None = None, **config) -> Iterator[Served]:
    """Serve `engine` on 127.0.0.1 (a free port) for the duration of the block."""
    settings = replace(ServeConfig(MODEL), gateway=gateway or GatewayConfig(api_keys=frozenset({KEY})), **config)
    telemetry = TelemetryLog()
    app = build_app(engine, settings, telemetry)
    server = start_in_thread(app, "127.0.0.1", 0)
    try:
        yield Served(server.url, telemetry, engine, app[CONNECTION_GUARD])
    finally:
        server.stop()


@dataclass(frozen=True)
class RawResponse:
    """A response as bytes, with its status and headers."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        """The body parsed as JSON."""
        return json.loads(self.body)


def raw_request(
    url: str,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict[str, str] | None = None,
    chunked: bool = False,
    content_type: str | None = "application/json",
) -> RawResponse:
    """One HTTP request with the standard library, so the bytes on the wire are the server's own.

    `content_type` None sends no Content-Type header at all.
    """
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    sent_headers = {} if content_type is None else {"Content-Type": content_type}
    sent_headers.update(headers or {})
    try:
        if chunked:
            conn.request(method, path, body=iter([payload]), headers=sent_headers, encode_chunked=True)
        else:
            conn.request(method, path, body=payload, headers=sent_headers)
        resp = conn.getresponse()
        return RawResponse(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def authorized(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the test API key."""
    return {"Authorization": f"Bearer {KEY}", **(headers or {})}


def chat_body(text: str = "Hello there", **fields) -> dict:
    """A chat completion body for the served model."""
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


def refused_at_the_door(served, caplog, changes: dict, param: str) -> dict:
    """Send a short chat body with `changes`; assert a 400 of OpenAI's shape naming `param`, a one-line
    message, and nothing in the error log (no traceback); return the error object."""
    import logging

    with caplog.at_level(logging.ERROR):
        resp = raw_request(served.url, "POST", "/v1/chat/completions", {**chat_body(max_tokens=2), **changes},
                           authorized())  # fmt: skip
    assert resp.status == 400, resp.body
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"]
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no traceback in the log
    return error


def sse_payloads(body: bytes) -> list[str]:
    """The data of each server-sent event, checking the framing on the way."""
    text = body.decode("utf-8")
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def engine_result(engine: Engine, request: GenerationRequest) -> RequestResult:
    """Run `request` on the engine directly (the reference the server must match)."""
    return next(e for e in engine.generate(request) if isinstance(e, DoneEvent)).result


async def first_texts(resp: aiohttp.ClientResponse, count: int) -> list[str]:
    """Read a streamed answer's SSE lines until `count` chunks of visible text have arrived; return them."""
    texts = []
    while len(texts) < count:
        line = (await resp.content.readline()).decode().strip()
        if line.startswith("data: {"):
            choice = json.loads(line[len("data: ") :])["choices"][0]
            if choice["delta"].get("content"):
                texts.append(choice["delta"]["content"])
    return texts


async def wait_for_waiting(session: aiohttp.ClientSession, url: str, count: int) -> None:
    """Poll the server's /health until `count` requests wait in its queue (5 s at most)."""
    for _ in range(500):
        async with session.get(url + "/health") as resp:
            if (await resp.json())["waiting"] == count:
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the queue never held {count} request(s)")


def scrape(served, headers: dict[str, str] | None = None) -> dict[str, dict[tuple, float]]:
    """sample name -> {labels (without model_name) as sorted pairs: value}."""
    resp = raw_request(served.url, "GET", "/metrics", headers=headers if headers is not None else authorized())
    assert resp.status == 200, resp.body
    assert resp.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.body.decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL
            samples.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = sample.value
    return samples


def one(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    """The value of `name` with `labels` in a `scrape`."""
    return samples[name][tuple(sorted(labels.items()))]
