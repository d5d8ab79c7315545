"""`reqscope serve` driven over loopback: the official openai client, raw SSE framing, completions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
from openai import OpenAI
from serve_harness import KEY, MODEL, authorized, chat_body, engine_result, raw_request, sse_payloads

from minengine.engine.events import TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


def _request_id(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def test_openai_client_streams_a_chat_completion(served, client, engine):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Explain what a KV cache is in three sentences."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    reference = engine_result(
        engine,
        GenerationRequest.from_prompt("Explain what a KV cache is in three sentences.", sampling=GREEDY, max_tokens=8),
    )
    assert text == reference.text
    assert chunks[-1].usage.prompt_tokens == reference.usage.prompt_tokens
    served_record = served.telemetry.wait_for(_request_id(chunks[0].id))
    assert served_record.result.text == text and served_record.result.finish_reason == "length"
    report = next(c.model_extra["reqscope"] for c in chunks if c.model_extra and "reqscope" in c.model_extra)
    assert report["request_id"] == _request_id(chunks[0].id)
    assert report["ttft_ms"] == pytest.approx(served_record.result.metrics.ttft_ms)
    assert set(report["stages_ms"]) >= {"gateway", "template", "tokenize", "admit", "prefill", "decode"}


def test_openai_client_non_streaming_with_logprobs_matches_the_engine(client, engine):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = response.choices[0]
    events = list(engine.generate(GenerationRequest.from_prompt("Hello there", sampling=GREEDY, max_tokens=6)))
    reference = events[-1].result
    traces = [e.trace for e in events if isinstance(e, TokenEvent)]
    assert choice.message.content == reference.text
    assert response.usage.completion_tokens == 6 == len(choice.logprobs.content)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6
    for entry, trace in zip(choice.logprobs.content, traces, strict=True):
        # Greedy: the chosen token is the likeliest, and logprobs are the raw model's.
        assert entry.logprob == pytest.approx(trace.chosen_logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) < 1
    assert response.model_extra["reqscope"]["usage"]["completion_tokens"] == 6


def test_raw_sse_framing_of_a_chat_stream(served):
    body = chat_body(max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})
    resp = raw_request(served.url, "POST", "/v1/chat/completions", body, authorized({"x-request-id": "trace-42"}))
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-request-id"] == "trace-42"
    payloads = sse_payloads(resp.body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-trace-42"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    role, *texts, finish, usage = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(texts) == 4 and all(t["choices"][0]["delta"]["content"] for t in texts)
    assert finish["choices"][0]["finish_reason"] == "length" and finish["reqscope"]["request_id"] == "trace-42"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_completions_endpoint_tokenizes_the_raw_prompt(served, engine):
    prompt = "Once upon a time"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True}
    resp = raw_request(served.url, "POST", "/v1/completions", body, authorized())
    payloads = sse_payloads(resp.body)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    reference = engine_result(engine, GenerationRequest.from_text(prompt, sampling=GREEDY, max_tokens=5))
    assert text == reference.text
    assert reference.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))  # no chat template around it
    full = raw_request(served.url, "POST", "/v1/completions", {**body, "stream": False}, authorized()).json()
    assert full["choices"][0]["text"] == text and full["usage"]["prompt_tokens"] == reference.usage.prompt_tokens


def test_models_and_health(served):
    models = raw_request(served.url, "GET", "/v1/models", headers=authorized()).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 2048
    health = raw_request(served.url, "GET", "/health")  # no key needed
    assert health.status == 200 and health.json()["running"] == 0


def test_serve_command_listens_on_loopback_and_answers(chatty_tiny_dir, tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    command = [sys.executable, "-m", "reqscope", "serve", "--model", str(chatty_tiny_dir), "--device", "cpu"]
    command += ["--dtype", "float32", "--kv-budget-mib", "64", "--port", "0", "--served-model-name", MODEL]
    command += ["--telemetry", str(telemetry)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "serving" in line:
                url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        assert url is not None and url.startswith("http://127.0.0.1:")
        resp = raw_request(url, "POST", "/v1/chat/completions", chat_body(max_tokens=3, temperature=0))
        assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 3
        record = json.loads(telemetry.read_text().splitlines()[-1])
        assert record["request_id"] == resp.headers["x-request-id"] and record["finish_reason"] == "length"
        assert record["endpoint"] == "/v1/chat/completions"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sampling_parameters_and_stop_reach_the_engine(client, engine):
    def complete(**params) -> tuple[str, str]:
        messages = [{"role": "user", "content": "Hello there"}]
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **params)
        return response.choices[0].message.content, response.choices[0].finish_reason

    greedy = engine_result(engine, GenerationRequest.from_prompt("Hello there", sampling=GREEDY, max_tokens=8)).text
    # top_k=1 and min_p=1 each leave only the argmax: sampling at temperature 1 must equal greedy.
    assert complete(temperature=1.0, top_p=1.0, extra_body={"top_k": 1}) == (greedy, "length")
    assert complete(temperature=1.0, extra_body={"min_p": 1.0}) == (greedy, "length")
    seeded = complete(temperature=1.0, seed=7)
    assert seeded == complete(temperature=1.0, seed=7) and seeded[0] != greedy  # sampled, and reproducibly
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 3]
    assert complete(temperature=0, stop=[stop]) == (greedy[: greedy.index(stop)], "stop")


def test_every_token_has_its_chunk_even_one_whose_text_is_held_back(served, engine):
    """As vLLM's server streams: a token that shows no text yet (here a stop string's start, held
    back until the next token rules the stop out) still gets its chunk, with empty content, so a
    client timing chunks sees every step rather than one gap of two."""
    events = list(engine.generate(GenerationRequest.from_prompt("Hello there", sampling=GREEDY, max_tokens=8)))
    texts = [e.text for e in events if isinstance(e, TokenEvent)]
    held = next(i for i in range(1, 7) if texts[i].strip())
    stop = texts[held] + "\u2603"  # starts like that token's text; the snowman never comes
    body = chat_body(max_tokens=8, temperature=0, stream=True, stop=[stop])
    resp = raw_request(served.url, "POST", "/v1/chat/completions", body, headers=authorized())
    choices = [c["choices"][0] for c in map(json.loads, sse_payloads(resp.body)[:-1]) if c.get("choices")]
    contents = [c["delta"]["content"] for c in choices if "role" not in c["delta"] and not c["finish_reason"]]
    # One chunk per token, then whatever the end released (text held back at the last token).
    assert len(contents) in (8, 9) and contents[held] == "" and contents[held + 1] == texts[held] + texts[held + 1]
    assert "".join(contents) == events[-1].result.text
