"""`reqscope serve` with the prefix cache: OpenAI's cached_tokens, telemetry, /metrics, the flag,
and the issue's check on the real default model (the same long prompt twice: same text, at
least 128 cached tokens, and a second TTFT at most 0.7 of the first)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from serve_harness import KEY, MODEL, authorized, chat_body, raw_request, serving

from minengine.engine.engine import Engine
from reqscope.cli import build_parser
from reqscope.commands.web import run_flags

CHAT = "/v1/chat/completions"
# The prompt: a long system prompt and a question, 352 tokens with the default model's template.
SYSTEM = (
    "You are Kyoto Access, an assistant for travellers who use wheelchairs or walk with difficulty. "
    "Answer with concrete, checked details: step-free entrances, lifts and their door widths, "
    "accessible rooms with roll-in showers and grab bars, ramps at temples and shrines, which "
    "buses kneel and which stations have platform lifts, taxis that take a folding or a power "
    "chair, and how far each place is from the nearest accessible toilet. When something is not "
    "known, say so and say who to ask: the hotel's front desk, the station staff, or the city's "
    "barrier-free map. Never guess a measurement. Keep answers short, in plain English, as a list "
    "when there are several options, and give the Japanese name of each place as well so that a "
    "taxi driver can read it. Prefer places that were renovated recently, since older buildings in "
    "Kyoto often have a step at the entrance even when they describe themselves as accessible. "
    "Mention seasonal crowds, which make narrow paths in Higashiyama hard to pass in spring and in "
    "autumn, and suggest the early morning for the busiest sights. If the traveller mentions a "
    "companion, an assistance dog or a medical device that needs power, take it into account. "
    "Hotels near Kyoto Station are the easiest base: the station has lifts to every platform, the "
    "bus terminal is level, and most large hotels there have at least one barrier-free room, though "
    "it must be booked by telephone or e-mail rather than online. Remind the traveller to ask for "
    "the bathroom's measurements before booking, and to confirm it a week ahead, in writing."
)
QUESTION = "Show me wheelchair-accessible hotels in Kyoto near the station."


def long_chat(**fields) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return {"model": MODEL, "messages": messages, "temperature": 0, **fields}


def test_cached_tokens_in_responses_telemetry_and_metrics(engine):
    with serving(engine) as served:
        first = raw_request(served.url, "POST", CHAT, long_chat(max_tokens=6), authorized())
        second = raw_request(served.url, "POST", CHAT, long_chat(max_tokens=6), authorized())
        assert first.status == second.status == 200, (first.body, second.body)
        record = served.telemetry.wait_for(second.headers["x-request-id"]).record()
        metrics = raw_request(served.url, "GET", "/metrics", headers=authorized()).body.decode()
    a, b = first.json(), second.json()
    assert a["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (b["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0  # every full block but the last token's
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    # The extension report and the telemetry record say what the stage found.
    assert b["reqscope"]["prefix_cache"]["reused_tokens"] == cached == record["usage"]["cached_tokens"]
    assert record["prefix_cache"]["blocks_hit"] == cached // 16
    assert record["prefix_cache"]["computed_tokens"] == b["usage"]["prompt_tokens"] - cached
    assert "prefix_cache" in record["stages_ms"]
    # /metrics: every prompt token looked up counts as a query, every reused one as a hit.
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    label = f'{{model_name="{MODEL}"}}'
    assert float(values[f"reqscope:prefix_cache_queries_total{label}"]) == 2 * b["usage"]["prompt_tokens"]
    assert float(values[f"reqscope:prefix_cache_hits_total{label}"]) == cached


def test_the_final_streamed_usage_carries_cached_tokens(engine):
    with serving(engine) as served:
        client = OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)
        usages = []
        for _ in range(2):
            stream = client.chat.completions.create(
                **long_chat(max_tokens=4), stream=True, stream_options={"include_usage": True}
            )
            usages.append(list(stream)[-1].usage)
    assert usages[1].prompt_tokens_details.cached_tokens >= 16
    assert usages[1].prompt_tokens == usages[0].prompt_tokens


def test_no_enable_prefix_caching_flag(chatty_tiny_dir):
    assert build_parser("serve").parse_args(["--no-enable-prefix-caching"]).prefix_cache is False
    assert build_parser("serve").parse_args(["--enable-prefix-caching"]).prefix_cache is True
    assert not hasattr(build_parser("serve").parse_args([]), "prefix_cache")  # the engine's default: on
    assert build_parser("run").parse_args(["--no-enable-prefix-caching", "hi"]).prefix_cache is False
    web = build_parser("web").parse_args(["--no-enable-prefix-caching"])
    assert run_flags(web) == ["--no-enable-prefix-caching"]
    assert run_flags(build_parser("web").parse_args([])) == []
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    with serving(engine) as served:
        for _ in range(2):
            resp = raw_request(served.url, "POST", CHAT, chat_body("Hello there", max_tokens=2), authorized())
            assert resp.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        metrics = raw_request(served.url, "GET", "/metrics", headers=authorized()).body.decode()
    assert f'reqscope:prefix_cache_queries_total{{model_name="{MODEL}"}} 0.0' in metrics


def test_run_reports_the_hit_in_json_mode(chatty_tiny_dir, capsys):
    from reqscope.cli import main

    argv = ["--json", "--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "2", "hi"]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    prefix = next(r for r in records if r["event"] == "prefix_cache")
    assert prefix["enabled"] and prefix["blocks_hit"] == 0  # one run per process: nothing kept yet
    assert records[-1]["usage"]["cached_tokens"] == 0
    assert main(["--no-enable-prefix-caching", *argv]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert next(r for r in records if r["event"] == "prefix_cache")["enabled"] is False


@pytest.mark.slow
def test_the_same_long_prompt_twice_on_the_default_model(default_model_dir):
    # An engine of its own: serving replaces its scheduler, and its prefix cache starts empty.
    engine = Engine(default_model_dir, device="cpu", dtype="float32", kv_budget_bytes=1 << 30)
    with serving(engine) as served:
        warm = raw_request(served.url, "POST", CHAT, chat_body("Say hello.", max_tokens=2), authorized())
        assert warm.status == 200  # first-request costs (allocations, threads) are not the first TTFT's
        first = raw_request(served.url, "POST", CHAT, long_chat(max_tokens=16), authorized()).json()
        second = raw_request(served.url, "POST", CHAT, long_chat(max_tokens=16), authorized()).json()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 352
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    ttft_first, ttft_second = first["reqscope"]["ttft_ms"], second["reqscope"]["ttft_ms"]
    print(f"\nTTFT {ttft_first:.1f} ms, then {ttft_second:.1f} ms with "
          f"{second['usage']['prompt_tokens_details']['cached_tokens']} cached tokens")  # fmt: skip
    assert ttft_second <= 0.7 * ttft_first, (ttft_first, ttft_second)
