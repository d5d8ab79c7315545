"""`reqscope serve`'s /metrics (Prometheus text, vLLM's names) and its access log."""

from __future__ import annotations

import io
import logging
import socket
import sys
import time
from urllib.parse import urlsplit

import pytest
from aiohttp.http_exceptions import BadHttpMessage
from serve_harness import authorized, chat_body, one, raw_request, scrape, serving

from reqscope.serve.access import ACCESS_LOGGER, ClientErrorsInOneLine, configure_logging
from reqscope.serve.gateway import GatewayConfig
from reqscope.serve.prometheus import token_count_buckets

CHAT = "/v1/chat/completions"
KEYLESS = GatewayConfig()


def test_metrics_after_one_request_carry_vllms_names_and_the_engines_numbers(engine):
    with serving(engine) as served:
        before = scrape(served)
        assert one(before, "reqscope:request_success_total", finished_reason="length") == 0
        resp = raw_request(served.url, "POST", CHAT, chat_body(max_tokens=6, temperature=0), authorized())
        assert resp.status == 200, resp.body
        usage = resp.json()["usage"]
        result = served.telemetry.wait_for(resp.headers["x-request-id"]).result
        after = scrape(served)
    m = result.metrics
    assert one(after, "reqscope:request_success_total", finished_reason=resp.json()["choices"][0]["finish_reason"]) == 1
    assert one(after, "reqscope:prompt_tokens_total") == usage["prompt_tokens"] > 0
    assert one(after, "reqscope:generation_tokens_total") == usage["completion_tokens"] > 0
    assert one(after, "reqscope:num_preemptions_total") == 0  # vLLM's name; a request alone is never preempted
    assert one(after, "reqscope:time_to_first_token_seconds_count") == 1
    assert one(after, "reqscope:time_to_first_token_seconds_sum") == pytest.approx(m.ttft_ms / 1000)
    assert one(after, "reqscope:e2e_request_latency_seconds_sum") == pytest.approx(m.e2e_ms / 1000)
    assert one(after, "reqscope:time_per_output_token_seconds_sum") == pytest.approx(m.tpot_ms / 1000)
    assert one(after, "reqscope:inter_token_latency_seconds_count") == m.itl.count > 0
    assert one(after, "reqscope:inter_token_latency_seconds_sum") == pytest.approx(m.itl.mean * m.itl.count / 1000)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert one(after, f"reqscope:{name}_count") == 1, name
    # Nothing runs or waits between requests.
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert one(after, f"reqscope:{name}") == 0, name
    # The prompt was looked up in the prefix cache (tests/serve/test_serve_prefix_cache.py has hits).
    assert one(after, "reqscope:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert one(after, "reqscope:prefix_cache_hits_total") == usage["prompt_tokens_details"]["cached_tokens"]
    ttft_buckets = {dict(k)["le"] for k in after["reqscope:time_to_first_token_seconds_bucket"]}
    assert {"0.001", "0.5", "2560.0", "+Inf"} <= ttft_buckets  # vLLM's buckets


def test_running_waiting_and_kv_usage_are_read_at_scrape_time(engine):
    with serving(engine) as served:
        scheduler = engine.scheduler
        admission = scheduler.admit("held", prompt_tokens=1, max_tokens=1, context_limit=10, kv_bytes=16 << 20)
        try:
            samples = scrape(served)
        finally:
            scheduler.release(admission)
    assert one(samples, "reqscope:num_requests_running") == 1
    assert one(samples, "reqscope:kv_cache_usage_perc") == pytest.approx(0.25)  # 16 of the 64 MiB budget


def test_each_server_counts_its_own_requests(engine):
    with serving(engine) as first, serving(engine, KEYLESS) as second:
        resp = raw_request(first.url, "POST", CHAT, chat_body(max_tokens=2), authorized())
        assert first.telemetry.wait_for(resp.headers["x-request-id"]) is not None  # counted before it is recorded
        assert sum(scrape(first)["reqscope:request_success_total"].values()) == 1
        assert sum(scrape(second, headers={})["reqscope:request_success_total"].values()) == 0


def test_metrics_need_the_api_key_when_one_is_set(engine):
    with serving(engine) as served:
        assert raw_request(served.url, "GET", "/metrics").status == 401
        wrong = raw_request(served.url, "GET", "/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert raw_request(served.url, "GET", "/metrics", headers=authorized()).status == 200
    with serving(engine, KEYLESS) as open_server:
        assert raw_request(open_server.url, "GET", "/metrics").status == 200


def test_token_count_buckets_are_vllms_1_2_5():
    assert token_count_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


# -- the access log ---------------------------------------------------------------------------


def access_records(caplog, request_id: str, timeout_s: float = 10.0) -> list:
    """The access records of `request_id`, waiting for the line (written when the request is over)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r.access for r in caplog.records if r.name == ACCESS_LOGGER and r.access.request_id == request_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_one_access_line_per_request_with_the_fields_that_apply(engine, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with serving(engine) as served:
        chat = raw_request(served.url, "POST", CHAT, chat_body(max_tokens=4, temperature=0), authorized())
        refused = raw_request(served.url, "POST", CHAT, {**chat_body(), "best_of": 3}, authorized())
        scraped = raw_request(served.url, "GET", "/metrics")
    (line,) = access_records(caplog, chat.headers["x-request-id"])
    usage = chat.json()["usage"]
    assert (line.method, line.path, line.status, line.client) == ("POST", CHAT, 200, "127.0.0.1")
    assert (line.prompt_tokens, line.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert line.finish_reason == "length" and 0 < line.ttft_ms <= line.e2e_ms <= line.duration_ms
    text = line.line()
    assert text.startswith(f"POST {CHAT} 200 {chat.headers['x-request-id']} client=127.0.0.1 prompt_tokens=")
    assert "ttft_ms=" in text and "e2e_ms=" in text
    (bad,) = access_records(caplog, refused.headers["x-request-id"])
    assert bad.status == 400 and bad.prompt_tokens is None and "ttft_ms" not in bad.line()
    (unauthorized,) = access_records(caplog, scraped.headers["x-request-id"])
    assert (unauthorized.method, unauthorized.path, unauthorized.status) == ("GET", "/metrics", 401)
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a client's error"


def test_a_client_that_leaves_mid_stream_is_logged_once_when_its_request_ends(engine, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with serving(engine) as served:
        parts = urlsplit(served.url)
        body = (
            b'{"model": "chatty", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, '
            b'"stream": true, "ignore_eos": true}'
        )
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\nx-request-id: leaver-1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(head.encode() + body)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert access_records(caplog, "leaver-1")  # the line comes once the engine has stopped
        time.sleep(0.3)  # a second line, were there one, would have come by now
        records = access_records(caplog, "leaver-1")
    assert len(records) == 1, records
    (line,) = records
    assert line.status == 200 and line.finish_reason == "abort" and line.output_tokens < 1500


def test_aiohttps_tracebacks_for_non_http_bytes_become_one_line():
    try:
        raise BadHttpMessage("Received HTTPS traffic on an HTTP port\n  more")
    except BadHttpMessage:
        record = logging.LogRecord("aiohttp.server", logging.DEBUG, __file__, 1, "Error handling request from %s",
                                   ("127.0.0.1",), sys.exc_info())  # fmt: skip
    ClientErrorsInOneLine().filter(record)
    text = logging.Formatter().format(record)
    assert "Traceback" not in text and "\n" not in text
    assert text == "Error handling request from 127.0.0.1: 400 Received HTTPS traffic on an HTTP port more"


def test_log_level_configures_serve_logging():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    out = io.StringIO()
    try:
        configure_logging("warning", out)
        logging.getLogger(ACCESS_LOGGER).info("not shown")
        logging.getLogger("reqscope.serve").warning("shown")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert "not shown" not in out.getvalue()
    assert out.getvalue().rstrip().endswith("WARNING reqscope.serve: shown")
