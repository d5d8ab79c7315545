"""`reqscope bench serve` on loopback: fake OpenAI servers with known chunk timings and failures, and `reqscope serve`.

The fakes stream on a schedule (first chunk after FIRST_S, then one every GAP_S), so the
client's figures must land near the schedule; exactly, they must be the seeds' formulas over
what the client recorded. Sleeps are short and the runs small: every test here ends in seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from aiohttp import web
from serve_harness import KEY, MODEL, serving

from minengine.engine.engine import Engine
from minengine.engine.metrics import percentile
from minengine.text.tokenizer import ModelTokenizer
from reqscope.bench.serve.arrivals import send_offsets
from reqscope.bench.serve.prompts import PromptShape, random_prompts
from reqscope.cli import main
from reqscope.serve.runner import start_in_thread

FIRST_S = 0.15  # the fake's wait before its first chunk
GAP_S = 0.10  # and between chunks
CHUNKS = ("Hello", " there", " two tokens", " end")  # the third carries two tokens
OUTPUT_TOKENS = 5  # what the fake's usage says
SLACK_MS = 60.0  # loopback, a shared 2-core machine and the event loop's own timer granularity


@dataclass
class Fake:
    """What a fake server saw, and how it answers request number n (counted from 0)."""

    fail: dict[int, str] = field(default_factory=dict)  # n -> "http" | "close" | "sse-error" | "drop"
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    client_ports: set[int] = field(default_factory=set)  # one per connection the client opened
    chunks: tuple[str, ...] = CHUNKS  # the texts sent, one chunk each on the schedule


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def _fake_app(fake: Fake) -> web.Application:
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(fake.bodies)
        fake.bodies.append(body)
        fake.client_ports.add(request.transport.get_extra_info("peername")[1])
        how = fake.fail.get(n)
        if how == "drop":  # the connection closed before any answer, as a server ends a kept-alive one
            request.transport.close()
            return web.Response()
        if how == "http":
            return web.json_response({"error": {"message": f"request {n} refused", "type": "server_error"}}, status=503)
        fake.in_flight += 1
        fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chat = "messages" in body
            for i, text in enumerate(fake.chunks):
                await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                await resp.write(_event({"choices": [{**choice, "finish_reason": None}]}))
                if i == 1 and how == "close":
                    request.transport.close()  # the server goes away mid-stream
                    return resp
                if i == 1 and how == "sse-error":
                    await resp.write(_event({"error": {"message": "engine fell over"}}))
                    await resp.write(_event("[DONE]"))
                    return resp
            usage = {"prompt_tokens": 40, "completion_tokens": OUTPUT_TOKENS, "total_tokens": 40 + OUTPUT_TOKENS}
            await resp.write(_event({"choices": [], "usage": usage}))
            await resp.write(_event("[DONE]"))
            await resp.write_eof()
            return resp
        finally:
            fake.in_flight -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


@contextmanager
def fake_server(fake: Fake) -> Iterator[str]:
    """The fake on 127.0.0.1 (a free port); yields its base URL, without /v1."""
    server = start_in_thread(_fake_app(fake))
    try:
        yield server.url
    finally:
        server.stop()


def bench_serve(capsys, *flags: str) -> tuple[int, str, str]:
    """`reqscope bench serve FLAGS`: (exit code, stdout, stderr)."""
    code = main(["bench", "serve", *flags])
    out, err = capsys.readouterr()
    return code, out, err


SMALL = ("--input-len", "16", "--output-len", "5")


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_dir):
    return default_model_dir


# -- the figures -------------------------------------------------------------------------------


def test_figures_follow_the_seeds_formulas_and_the_fakes_schedule(capsys, tokenizer_dir):
    fake = Fake()
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, "--base-url", url, "--tokenizer", str(tokenizer_dir), "--num-prompts", "4", *SMALL, "--json"
        )
    assert code == 0
    result = json.loads(out)
    assert (result["completed"], result["failed"], result["model_id"]) == (4, 0, "fake-model")  # from /v1/models
    # O comes from usage (5), not the chunk count (4): TPOT and the mean ITL part ways, as the seeds say.
    assert result["output_lens"] == [OUTPUT_TOKENS] * 4 and result["total_output_tokens"] == 4 * OUTPUT_TOKENS
    assert result["input_lens"] == [40] * 4  # the server's usage.prompt_tokens
    for ttft, e2el, itls in zip(result["ttfts_ms"], result["e2els_ms"], result["itls_ms"], strict=True):
        assert len(itls) == len(CHUNKS) - 1
        # E2EL - TTFT is the sum of the gaps: one clock, first to last chunk.
        assert math.isclose(e2el - ttft, sum(itls), abs_tol=1e-6)
        assert abs(ttft - FIRST_S * 1000) < SLACK_MS
        assert all(abs(gap - GAP_S * 1000) < SLACK_MS for gap in itls)
    times = zip(result["ttfts_ms"], result["e2els_ms"], strict=True)
    tpots = [(e2el - ttft) / (OUTPUT_TOKENS - 1) for ttft, e2el in times]
    assert math.isclose(result["mean_tpot_ms"], statistics.fmean(tpots), rel_tol=1e-9)
    assert math.isclose(result["median_tpot_ms"], statistics.median(tpots), rel_tol=1e-9)
    every_gap = sorted(gap for itls in result["itls_ms"] for gap in itls)
    assert math.isclose(result["mean_itl_ms"], statistics.fmean(every_gap), rel_tol=1e-9)
    assert math.isclose(result["p99_itl_ms"], percentile(every_gap, 99), rel_tol=1e-9)
    assert math.isclose(result["std_ttft_ms"], statistics.pstdev(result["ttfts_ms"]), rel_tol=1e-6, abs_tol=1e-9)
    # TPOT = 3 gaps over 4 token transitions: 3/4 of the mean ITL here.
    assert abs(result["mean_tpot_ms"] - 0.75 * GAP_S * 1000) < SLACK_MS
    assert math.isclose(result["output_throughput"], 4 * OUTPUT_TOKENS / result["duration"], rel_tol=1e-9)
    assert math.isclose(result["total_token_throughput"], 4 * (40 + OUTPUT_TOKENS) / result["duration"], rel_tol=1e-9)
    assert math.isclose(result["request_throughput"], 4 / result["duration"], rel_tol=1e-9)
    # What every request asked for: a stream with usage, --output-len tokens and ignore_eos, greedy.
    for body in fake.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert (body["max_tokens"], body["ignore_eos"], body["temperature"]) == (5, True, 0.0)
        assert body["model"] == "fake-model" and isinstance(body["prompt"], str)


def test_the_summary_is_vllms_block_and_the_chat_route_sends_messages(capsys, tokenizer_dir, tmp_path):
    fake = Fake()
    saved = tmp_path / "result.json"
    with fake_server(fake) as url:
        code, out, err = bench_serve(
            capsys, "--base-url", url + "/v1", "--endpoint", "/v1/chat/completions", "--model", "m",
            "--tokenizer", str(tokenizer_dir), "--num-prompts", "3", "--max-concurrency", "2", *SMALL,
            "--no-ignore-eos", "--output", str(saved),
        )  # fmt: skip
    assert code == 0
    labels = [line.split(":")[0] for line in out.splitlines()]
    assert labels == [
        "============ Serving Benchmark Result ============",
        "Successful requests", "Failed requests", "Maximum request concurrency", "Benchmark duration (s)",
        "Total input tokens", "Total generated tokens", "Request throughput (req/s)",
        "Output token throughput (tok/s)", "Total Token throughput (tok/s)",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms)", "Median TTFT (ms)", "P99 TTFT (ms)",
        "-----Time per Output Token (excl. 1st token)------",
        "Mean TPOT (ms)", "Median TPOT (ms)", "P99 TPOT (ms)",
        "---------------Inter-token Latency----------------",
        "Mean ITL (ms)", "Median ITL (ms)", "P99 ITL (ms)",
        "----------------End-to-end Latency----------------",
        "Mean E2EL (ms)", "Median E2EL (ms)", "P99 E2EL (ms)",
        "==================================================",
    ]  # fmt: skip
    assert "Successful requests:                     3" in out
    result = json.loads(saved.read_text())
    assert f"Mean TTFT (ms):                          {result['mean_ttft_ms']:.2f}" in out
    assert result["backend"] == "openai-chat" and result["completed"] == 3
    assert all(b["messages"][0]["role"] == "user" and "ignore_eos" not in b for b in fake.bodies)
    assert url + "/v1/v1" not in json.dumps(result)  # the /v1 of the base URL is not doubled
    assert "requests" in err  # the progress line, on stderr


def test_output_lens_from_gives_each_request_the_length_its_twin_had(capsys, tokenizer_dir, tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"output_lens": [7, 2, 11]}))
    fake = Fake()
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, "--base-url", url, "--tokenizer", str(tokenizer_dir), "--num-prompts", "3", "--num-warmups",
            "1", "--max-concurrency", "1", *SMALL, "--output-lens-from", str(earlier), "--json",
        )  # fmt: skip
    assert code == 0
    # The warm-up keeps --output-len; the requests take the earlier run's lengths, in order.
    assert [b["max_tokens"] for b in fake.bodies] == [5, 7, 2, 11]
    assert json.loads(out)["output_lens_from"] == str(earlier)  # the result says where they came from


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read --output-lens-from"),
        ("not json", "is not a bench serve result"),
        ('{"duration": 1}', "has no output_lens list"),
        ('{"output_lens": [3, 4]}', "holds 2 requests, not 3: pass --num-prompts 2"),
        ('{"output_lens": [3, 0, 4]}', "has failed requests"),
    ],
)
def test_a_bad_output_lens_file_is_a_one_line_error(capsys, tokenizer_dir, tmp_path, content, says):
    path = tmp_path / "lens.json"
    if content is not None:
        path.write_text(content)
    code, out, err = bench_serve(
        capsys, "--model", "m", "--tokenizer", str(tokenizer_dir), "--num-prompts", "3", "--output-lens-from",
        str(path),
    )  # fmt: skip
    assert code == 1 and out == "" and says in err and err.count("\n") == 1


@pytest.mark.parametrize("every_chunk", (False, True))
def test_a_token_with_no_text_yet_is_one_gap_of_two_steps_or_two_with_time_every_chunk(
    capsys, tokenizer_dir, every_chunk
):
    # A server sends a chunk for a token whose text it holds back (vLLM does, and reqscope serve):
    # the seeds' points (visible text) see one gap of two steps there, vLLM's client two gaps.
    fake = Fake(chunks=("Hello", "", " there", " end"))
    flags = ("--time-every-chunk",) if every_chunk else ()
    with fake_server(fake) as url:
        common = ("--base-url", url, "--endpoint", "/v1/chat/completions", "--tokenizer", str(tokenizer_dir), *SMALL)
        code, out, _ = bench_serve(capsys, *common, "--num-prompts", "2", *flags, "--json")
        summary_code, summary, _ = bench_serve(capsys, *common, "--num-prompts", "1", *flags)
    result = json.loads(out)
    assert code == summary_code == 0 and result["completed"] == 2
    assert result["timed_chunks"] == ("every" if every_chunk else "visible text")
    for itls in result["itls_ms"]:
        assert [round(gap / (GAP_S * 1000)) for gap in itls] == ([1, 1, 1] if every_chunk else [2, 1])
    assert ("Timed chunks:                            every chunk with a choice" in summary) == every_chunk


def test_max_concurrency_caps_the_requests_in_flight_over_kept_connections(capsys, tokenizer_dir):
    fake = Fake()
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, "--base-url", url, "--model", "m", "--tokenizer", str(tokenizer_dir), "--num-prompts", "6",
            "--max-concurrency", "2", *SMALL, "--json",
        )  # fmt: skip
    assert code == 0 and json.loads(out)["completed"] == 6
    assert fake.most_in_flight == 2
    assert len(fake.client_ports) == 2  # each stream read to its end, so its connection is used again


# -- failures ------------------------------------------------------------------------------------


def test_failed_requests_are_counted_with_the_first_error(capsys, tokenizer_dir):
    fake = Fake(fail={1: "http", 3: "close", 4: "sse-error"})
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, "--base-url", url, "--model", "m", "--tokenizer", str(tokenizer_dir), "--num-prompts", "6",
            "--max-concurrency", "1", *SMALL,
        )  # fmt: skip
    assert code == 0
    assert "Successful requests:                     3" in out
    assert "Failed requests:                         3" in out
    assert "First error: HTTP 503: request 1 refused" in out
    assert "Total generated tokens:                  15" in out  # only the successful requests count


def test_a_connection_closed_before_any_answer_is_sent_again(capsys, tokenizer_dir):
    fake = Fake(fail={1: "drop", 3: "drop", 4: "drop", 5: "drop", 6: "drop"})
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, "--base-url", url, "--model", "m", "--tokenizer", str(tokenizer_dir), "--num-prompts", "3",
            "--max-concurrency", "1", *SMALL, "--json",
        )  # fmt: skip
    result = json.loads(out)
    assert code == 0 and result["completed"] == 2 and result["failed"] == 1
    # request 0; request 1 dropped, then sent again (2); request 2 dropped on all four tries (3-6)
    assert len(fake.bodies) == 7 and fake.bodies[1] == fake.bodies[2] and fake.bodies[3] == fake.bodies[6]
    assert "ServerDisconnectedError" in result["errors"][2] and result["errors"][:2] == ["", ""]


def test_the_errors_say_what_happened_to_each_request(capsys, tokenizer_dir):
    fake = Fake(fail={0: "close", 1: "sse-error"})
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, "--base-url", url, "--model", "m", "--tokenizer", str(tokenizer_dir), "--num-prompts", "3",
            "--max-concurrency", "1", *SMALL, "--json",
        )  # fmt: skip
    errors = json.loads(out)["errors"]
    assert code == 0 and errors[2] == ""
    assert "ClientPayloadError" in errors[0] or "before [DONE]" in errors[0]
    assert errors[1] == "engine fell over"


def test_a_refused_connection_fails_every_request(capsys, tokenizer_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, out, _ = bench_serve(
        capsys, "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", str(tokenizer_dir),
        "--num-prompts", "3", *SMALL,
    )  # fmt: skip
    assert code == 0
    assert "Successful requests:                     0" in out and "Failed requests:                         3" in out
    assert "First error: ClientConnectorError" in out
    assert "Mean TTFT (ms):                          n/a" in out


def test_without_a_model_an_unreachable_server_is_a_one_line_error(capsys, tokenizer_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = bench_serve(capsys, "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(tokenizer_dir))
    assert code == 1 and out == ""
    assert err.startswith("reqscope: error: cannot reach") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--request-rate", "0"], "--request-rate"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--num-prompts", "-1"], "--num-prompts"),
        (["--random-range-ratio", "1"], "--random-range-ratio"),
        (["--input-len", "many"], "--input-len"),
        (["--endpoint", "/v1/embeddings"], "is not a completions route"),
    ],
)
def test_bad_flags_are_one_line_errors(capsys, flags, named):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and named in err
    assert "reqscope bench serve --help" in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--base-url", "localhost:8000"], "is not an http(s) URL"),
        (["--tokenizer", "/nonexistent"], "no tokenizer.json in /nonexistent"),
    ],
)
def test_bad_values_are_one_line_errors(capsys, flags, says):
    code, out, err = bench_serve(capsys, "--model", "m", *flags)
    assert code == 1 and out == "" and says in err and err.count("\n") == 1


# -- the parts -----------------------------------------------------------------------------------


def test_prompts_have_the_lengths_asked_for_in_the_tokenizer(tokenizer_dir):
    tokenizer = ModelTokenizer(tokenizer_dir)
    prompts = random_prompts(tokenizer, PromptShape(64, 8), 8, seed=3)
    assert [p.prompt_len for p in prompts] == [64] * 8
    assert all(len(tokenizer.encode(p.text)) == 64 for p in prompts)
    assert len({p.text for p in prompts}) == 8  # random: no two alike, so no prefix-cache hits between them
    assert prompts == random_prompts(tokenizer, PromptShape(64, 8), 8, seed=3)  # the seed fixes them
    spread = random_prompts(tokenizer, PromptShape(100, 20, range_ratio=0.5, prefix_len=10), 16, seed=1)
    assert all(55 <= p.prompt_len <= 165 and 10 <= p.output_len <= 30 for p in spread)
    assert len({p.prompt_len for p in spread}) > 1
    assert len({p.text[:20] for p in spread}) == 1  # the shared prefix


def test_arrivals_are_all_at_once_or_poisson_at_the_rate():
    assert send_offsets(5, math.inf, 1.0, seed=0) == (0.0,) * 5
    offsets = send_offsets(4000, 20.0, 1.0, seed=7)
    gaps = [b - a for a, b in pairwise(offsets)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(statistics.fmean(gaps) - 1 / 20) < 0.005  # mean gap 1 / rate
    assert abs(statistics.pstdev(gaps) / statistics.fmean(gaps) - 1) < 0.1  # exponential: cv 1
    even = send_offsets(4000, 20.0, 4.0, seed=7)
    even_gaps = [b - a for a, b in pairwise(even)]
    assert abs(statistics.pstdev(even_gaps) / statistics.fmean(even_gaps) - 0.5) < 0.1  # gamma k=4: cv 1/2
    assert send_offsets(10, 20.0, 1.0, seed=7) == offsets[:10]


def test_bench_keeps_its_flags_and_gains_the_serve_mode(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench_help = capsys.readouterr().out
    assert "--rounds ROUNDS" in bench_help and "--peer NAME" in bench_help and "serve" in bench_help
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "--num-prompts" in serve_help and "--max-concurrency" in serve_help and "--rounds" not in serve_help


# -- against reqscope serve ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)
    with serving(engine) as s:
        yield s


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_against_reqscope_serve(capsys, served, chatty_tiny_dir, endpoint):
    code, out, _ = bench_serve(
        capsys, "--base-url", served.url, "--endpoint", endpoint, "--api-key", KEY, "--tokenizer",
        str(chatty_tiny_dir), "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "32",
        "--output-len", "8", "--json",
    )  # fmt: skip
    result = json.loads(out)
    assert code == 0 and (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["model_id"] == MODEL
    assert result["output_lens"] == [8] * 4  # ignore_eos: every request ran to --output-len
    if endpoint == "/v1/completions":
        assert result["input_lens"] == [32] * 4  # the prompts measure 32 in the server's own tokenizer
    else:
        assert all(n > 32 for n in result["input_lens"])  # the chat template's tokens too
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and len(result["itls_ms"][0]) >= 1
