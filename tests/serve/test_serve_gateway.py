"""The gateway of `reqscope serve`: 401, 413, 400 naming the field, 429 with Retry-After, request IDs."""

from __future__ import annotations

import openai
import pytest
from serve_harness import KEY, MODEL, authorized, chat_body, raw_request, serving

from reqscope.cli import main
from reqscope.serve.gateway import GatewayConfig, RateLimiter


@pytest.fixture(scope="module")
def served(engine):
    with serving(engine, GatewayConfig(api_keys=frozenset({KEY}), max_body_bytes=4096)) as s:
        yield s


def test_missing_or_wrong_api_key_is_401(served):
    records_before = len(served.telemetry.recent())
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}):
        resp = raw_request(served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=2), headers)
        assert resp.status == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["x-request-id"].startswith("req-")
    wrong = openai.OpenAI(base_url=served.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert raw_request(served.url, "GET", "/health").status == 200  # probes need no key
    assert len(served.telemetry.recent()) == records_before  # refused at the gateway: the engine never ran


def test_body_over_the_limit_is_413_declared_or_chunked(served):
    big = chat_body("x" * 8000, max_tokens=2)
    declared = raw_request(served.url, "POST", "/v1/chat/completions", big, authorized())
    chunked = raw_request(served.url, "POST", "/v1/chat/completions", big, authorized(), chunked=True)
    for resp in (declared, chunked):
        assert resp.status == 413
        assert resp.json()["error"]["code"] == "payload_too_large"
    assert "8" in declared.json()["error"]["message"]  # names the size it got


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 500}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -3}, "top_k"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"stop": ["a"] * 9}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(served, changes, param):
    resp = raw_request(served.url, "POST", "/v1/chat/completions", {**chat_body(), **changes}, authorized())
    assert resp.status == 400, resp.body
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_malformed_json_unknown_model_and_unknown_route(served):
    broken = raw_request(served.url, "POST", "/v1/chat/completions", b"{not json", authorized())
    assert broken.status == 400 and broken.json()["error"]["param"] == "body"
    unknown = raw_request(served.url, "POST", "/v1/chat/completions", {**chat_body(), "model": "gpt-9"}, authorized())
    assert unknown.status == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert MODEL in unknown.json()["error"]["message"]
    route = raw_request(served.url, "GET", "/v1/embeddings", headers=authorized())
    assert route.status == 404 and "error" in route.json()


def test_over_context_is_400_from_admission(served):
    resp = raw_request(served.url, "POST", "/v1/chat/completions", chat_body(max_tokens=5000), authorized())
    assert resp.status == 400
    assert "exceeds the model's context of 2048" in resp.json()["error"]["message"]


def test_request_id_is_the_clients_when_sane(served):
    mine = raw_request(served.url, "GET", "/v1/models", headers=authorized({"x-request-id": "abc-123"}))
    assert mine.headers["x-request-id"] == "abc-123"
    odd = raw_request(served.url, "GET", "/v1/models", headers=authorized({"x-request-id": "<script>"}))
    assert odd.headers["x-request-id"].startswith("req-") and odd.headers["x-request-id"] != "<script>"


def test_rate_limit_is_per_key_with_retry_after(engine):
    gateway = GatewayConfig(api_keys=frozenset({"a", "b"}), rate_per_minute=60, rate_burst=2)
    with serving(engine, gateway) as served:

        def models(key: str):
            return raw_request(served.url, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})

        assert [models("a").status for _ in range(2)] == [200, 200]
        limited = models("a")
        assert limited.status == 429
        assert limited.headers["retry-after"] == "1"  # one request per second refills
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert models("b").status == 200  # another key has its own bucket


def test_rate_limiter_refills_at_its_rate():
    now = [100.0]
    limiter = RateLimiter(per_minute=30, burst=2, clock=lambda: now[0])  # one token per 2 s
    assert limiter.acquire("k") == 0 and limiter.acquire("k") == 0
    assert limiter.acquire("k") == pytest.approx(2.0)
    now[0] += 1.5
    assert limiter.acquire("k") == pytest.approx(0.5)
    now[0] += 0.5
    assert limiter.acquire("k") == 0
    now[0] += 60  # a long pause refills only up to the burst
    assert [limiter.acquire("k") for _ in range(3)][2] == pytest.approx(2.0)
    assert limiter.acquire("other") == 0


def test_a_keyless_loopback_server_answers_only_requests_addressed_to_this_machine(engine):
    # A web page reaching the server through a DNS-rebound name sends that name as Host.
    with serving(engine, GatewayConfig(loopback_hosts_only=True)) as s:
        port = s.url.rsplit(":", 1)[1]
        rebound = raw_request(s.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1),
                              {"Host": f"evil.example:{port}"})  # fmt: skip
        assert rebound.status == 403 and rebound.headers["x-request-id"]
        error = rebound.json()["error"]
        assert error["code"] == "host_not_allowed" and "--api-key" in error["message"]
        assert "'evil.example:" in error["message"]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            mine = raw_request(s.url, "POST", "/v1/chat/completions", chat_body(max_tokens=1), {"Host": host})
            assert mine.status == 200, host
        assert raw_request(s.url, "GET", "/v1/models", headers={"Host": "evil.example"}).status == 403
    with serving(engine, GatewayConfig(api_keys=frozenset({KEY}))) as keyed:  # a key is the login: any Host
        answer = raw_request(keyed.url, "GET", "/v1/models", headers={"Host": "models.example", **authorized()})
        assert answer.status == 200


def test_the_serve_command_guards_hosts_only_when_keyless_on_loopback(monkeypatch):
    from reqscope.commands import serve as command

    seen = {}

    def capture(engine, config, telemetry):
        seen["loopback_hosts_only"] = config.gateway.loopback_hosts_only
        raise SystemExit(0)

    monkeypatch.setattr(command, "build_app", capture)
    monkeypatch.setattr(command, "open_engine", lambda args, model, progress: _FakeEngine())
    monkeypatch.delenv("REQSCOPE_API_KEY", raising=False)
    for argv, expected in ((["serve"], True), (["serve", "--api-key", "k"], False),
                           (["serve", "--host", "0.0.0.0"], False)):  # fmt: skip
        with pytest.raises(SystemExit):
            main(argv)
        assert seen.pop("loopback_hosts_only") is expected, argv


class _FakeEngine:
    class _Path:
        name = "fake"

    model_dir = _Path()

    def prefault_kv(self, nbytes: int) -> int:
        return 0
