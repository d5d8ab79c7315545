"""The endpoint explorer driven with Textual's Pilot against `reqscope serve` on loopback.

Every figure on screen is checked against what the client measured (its EndpointResult) and
what the server recorded in its own telemetry; no test reaches an address outside 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest
from aiohttp import web
from rich.console import Console
from serve_harness import KEY, MODEL, serving
from textual.widgets import Input, Static
from ui_fixtures import wait_for

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.errors import RequestError
from minengine.kv.arithmetic import KIB, MIB, kv_bytes_per_token
from minengine.plan.cards import Architecture
from reqscope.cli import main
from reqscope.endpoint.events import ChunkReceived, ConnectionReady, RequestSent, ResponseStarted, StreamEnded
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.endpoint.trace import ENDPOINT_TRACE, read_endpoint_trace
from reqscope.serve.runner import start_in_thread
from reqscope.ui.endpoint.app import EndpointApp
from reqscope.ui.endpoint.settings_form import EndpointSettingsForm, parse_settings, settings_values
from reqscope.ui.endpoint.timeline_panel import client_events
from reqscope.ui.endpoint.view import EndpointView
from reqscope.ui.help_screen import HelpScreen
from reqscope.ui.outcome import endpoint_outcome

pytestmark = pytest.mark.anyio
TOKENS = 12
LONG = 1500  # far more tokens than a test waits for: the request is still streaming when cancelled
SMALL = (100, 30)
LARGE = (160, 48)
# The served model's shape as a card: what `--config` would give for the chatty tiny model.
TINY_ARCH = Architecture(name="chatty-tiny", layers=2, q_heads=4, kv_heads=2, head_dim=16, kv_dtype="float32")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def served(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)
    with serving(engine) as s:
        yield s


def request() -> GenerationRequest:
    return GenerationRequest.from_prompt("Hello there")


def settings(**changes) -> RequestSettings:
    """Greedy and TOKENS long, no logprobs (the default), unless changed."""
    return RequestSettings(temperature=0, max_tokens=TOKENS).with_(**changes)


def endpoint_app(served, *, api_key: str = KEY, new_connection: bool = False, **options) -> EndpointApp:
    target = EndpointTarget(served.v1, api_key=api_key, new_connection=new_connection)
    return EndpointApp(target, request(), settings=options.pop("settings", None) or settings(), **options)


def screen_text(app: EndpointApp, selector: str) -> str:
    """What a widget draws, as plain text."""
    widget = app.screen.query_one(selector)
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()


async def finished(pilot, app: EndpointApp) -> None:
    await wait_for(pilot, lambda: app.view.result is not None, timeout=60)
    await wait_for(pilot, lambda: not app.needs_repaint)


async def test_a_streamed_request_is_drawn_with_the_clients_and_the_servers_figures(served):
    app = endpoint_app(served)
    async with app.run_test(size=LARGE) as pilot:
        await finished(pilot, app)
        result = app.view.result
        server = served.telemetry.wait_for(result.request_id).result
        assert result.error is None and result.text == server.text
        assert app.state == "length" and app.wide

        answer = screen_text(app, "#tokens")
        assert f"output {TOKENS}/{TOKENS} tokens (usage)" in answer
        assert f"prompt {result.usage.prompt_tokens} · output" in answer
        assert f"in {result.chunks} chunks" in answer

        m = result.metrics
        latency = screen_text(app, "#latency")
        assert f"TTFT       {m.ttft_ms:.1f} ms" in latency
        assert f"E2E        {m.e2e_ms:.1f} ms" in latency
        assert f"TPOT       {m.tpot_ms:.2f} ms" in latency
        assert f"ITL median {m.itl.median:.2f} ms" in latency
        t = result.ttft
        assert t.server_ms == pytest.approx(server.metrics.ttft_ms)
        assert f"client     {t.client_ms:.1f} ms" in latency and f"server     {t.server_ms:.1f} ms" in latency
        assert f"outside    {t.outside_server_ms:.1f} ms" in latency
        assert f"prefill    {t.prefill_ms:.1f} ms" in latency
        assert t.client_ms - t.server_ms == pytest.approx(t.outside_server_ms)

        timeline = screen_text(app, "#timeline")
        for name in ("client_send", "first_byte", "first_visible_token", "last_visible_token", "completed"):
            assert name in timeline
        assert "connection_reused" in timeline  # the model list opened the connection the request reused
        assert f"token × {result.chunks}" in timeline
        for stage in ("gateway", "prefill", "decode"):
            assert stage in timeline  # the server's own stages, from its report

        pipeline = screen_text(app, "#pipeline")
        first_byte = app.view.response.t_ms - app.view.connection.t_ms
        assert f"{first_byte:.1f}ms HTTP 200" in pipeline and "reused" in pipeline

        status = screen_text(app, "#status")
        # The request's own name; the UUID sent as X-Request-Id (which the server echoes) matches its records.
        assert "done (length)" in status and f"model {MODEL}" in status and app.view.sent.display_id in status
        assert result.request_id == app.view.sent.request_id


async def test_logprobs_panel_shows_the_servers_entries_for_the_chunk_in_focus(served):
    app = endpoint_app(served, settings=settings(top_logprobs=2))
    async with app.run_test(size=LARGE) as pilot:
        await finished(pilot, app)
        chunks = app.view.chunks
        last = chunks[-1].logprobs[-1]
        text = screen_text(app, "#logits")
        assert f"chunk {len(chunks)} of {len(chunks)}" in text
        assert f"logprob {last.logprob:.3f}" in text
        assert "temperature 0, max_tokens 12; server default: top_k, top_p, min_p, seed" in text  # as sent
        assert "logprobs on (top 2 per token) · asking for logprobs can slow the server" in text
        assert all(len(entry.top) == 2 for entry in app.view.token_logprobs)
        assert all(f"{alt.logprob:8.3f}" in text for alt in last.top)
        # Greedy: the chosen token is every step's argmax, so it heads its own alternatives.
        assert all(entry.top[0].logprob == pytest.approx(entry.logprob) for entry in app.view.token_logprobs)

        await pilot.press("up")
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert app.cursor == len(chunks) - 2
        before = chunks[-2].logprobs[0]
        text = screen_text(app, "#logits")
        assert f"chunk {len(chunks) - 1} of {len(chunks)}" in text and f"logprob {before.logprob:.3f}" in text
        await pilot.press("down")
        assert app.cursor is None  # past the last chunk: follow the newest again


async def test_kv_panel_says_the_endpoint_hides_the_cache_and_computes_it_from_config(served):
    app = endpoint_app(served)
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        await pilot.press("2")
        text = screen_text(app, "#kv")
        assert "not exposed by the endpoint" in text and "pass --card MODEL" in text

    app = endpoint_app(served, arch=TINY_ARCH)
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        usage = app.view.result.usage
        per_token = kv_bytes_per_token(TINY_ARCH.layers, TINY_ARCH.kv_heads, TINY_ARCH.head_dim, 4)
        held = usage.prompt_tokens + usage.completion_tokens - 1  # the newest token is never fed back
        text = screen_text(app, "#kv")
        assert "not exposed by the endpoint" in text
        assert f"{per_token / KIB:.1f} KiB/token" in text
        assert f"{usage.prompt_tokens} prompt + {usage.completion_tokens - 1} output tokens" in text
        assert f"{held * per_token / MIB:.3f} MiB" in text
        mha = kv_bytes_per_token(TINY_ARCH.layers, TINY_ARCH.q_heads, TINY_ARCH.head_dim, 4)
        assert f"{held * mha / MIB:9.3f} MiB" in text  # the same tokens with MHA: q/kv times more


async def test_cancel_closes_the_stream_and_the_server_stops_decoding(served, monkeypatch):
    # The tiny model streams 1,500 tokens in about 2 s, which a loaded machine's app can take to
    # read its first chunks: each step is made to last 10 ms, so the cancel lands mid-stream.
    runner, forward_rows = served.engine.steps.runner, served.engine.steps.runner.forward_rows

    def slow(rows, computing=None):
        time.sleep(0.01)
        return forward_rows(rows, computing)

    monkeypatch.setattr(runner, "forward_rows", slow)
    app = endpoint_app(served, settings=settings(max_tokens=LONG))
    async with app.run_test(size=SMALL) as pilot:
        await wait_for(pilot, lambda: len(app.view.chunks) >= 3 or app.view.done, timeout=60)
        request_id = app.view.response.request_id
        await pilot.press("c")
        await wait_for(pilot, lambda: app.state == "cancelled")
        await wait_for(pilot, lambda: not app.needs_repaint)
        record = served.telemetry.wait_for(request_id).record()
        assert record["cancelled"] is True and record["finish_reason"] == "cancelled"
        assert record["usage"]["completion_tokens"] < LONG
        assert "cancelled" in screen_text(app, "#status")
        assert endpoint_outcome(app.view) == "cancelled"


@pytest.mark.parametrize("new_connection", [False, True])
async def test_restart_reuses_the_connection_unless_a_new_one_is_asked_for(served, new_connection):
    app = endpoint_app(served, new_connection=new_connection)
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        first = app.view.result.request_id
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
        assert len(app.history) == 1
        assert app.view.connection.reused is not new_connection
        assert (app.view.connection.connect_ms is not None) is new_connection


async def test_sampling_changes_go_with_the_next_request(served):
    app = endpoint_app(served)
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, EndpointSettingsForm))
        assert not app.screen.query("#field-order")  # the server picks its own sampler order
        assert app.screen.query_one("#field-top_k", Input).value == ""  # not set: the server's default
        for name, value in (("temperature", "0.8"), ("top_k", "5"), ("seed", "3"), ("max_tokens", "6")):
            app.screen.query_one(f"#field-{name}", Input).value = value
        await pilot.click("#apply")
        await wait_for(pilot, lambda: app.next_settings is not None)
        assert app.settings.temperature == 0  # the request on screen keeps what it was sent with
        assert "next: T 0.8 k 5 seed 3 max 6 · p min-p: server default, no logprobs" in screen_text(app, "#status")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.settings.max_tokens == 6)
        await finished(pilot, app)
        record = served.telemetry.wait_for(app.view.result.request_id).record()
        assert record["usage"]["completion_tokens"] <= 6
        assert app.view.sent.settings == RequestSettings(temperature=0.8, top_k=5, seed=3, max_tokens=6)
        assert "T 0.8 k 5" in screen_text(app, "#status") and "next:" not in screen_text(app, "#status")


async def test_a_refused_key_is_one_error_line_and_no_request(served):
    app = endpoint_app(served, api_key="wrong")
    async with app.run_test(size=SMALL) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None, timeout=30)
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert "refused the API key" in app.load_error and "--api-key" in app.load_error
        assert "refused the API key" in screen_text(app, "#error")
        assert app.state == "error" and app.run_ is None
        await pilot.press("r")  # nothing to resend: a note, not a crash
        assert app.run_ is None


async def test_help_lists_the_endpoint_keys(served):
    app = endpoint_app(served)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = screen_text(app, "#help-box Static")
        assert "close the stream" in text and "earlier chunk" in text and "next request" in text
        assert "Pick" not in text and "GQA" not in text  # engine-only keys are not offered


def test_the_client_timeline_folds_chunks_into_one_row():
    view = EndpointView.of([
        RequestSent(0.0, "http://127.0.0.1:1/v1", "m"),
        ConnectionReady(0.5, False, 0.4),
        ResponseStarted(2.0, 200, "req-1"),
        *[ChunkReceived(i, 10.0 + i, "x", None if i == 0 else 1.0, ()) for i in range(5)],
    ])
    names = [e.name for e in client_events(view)]
    assert names == ["client_send", "connection_new", "first_byte", "first_visible_token", "token × 5"]
    assert view.stage_ms("connect") == 0.4 and view.stage_ms("first byte") == 1.5
    assert view.stage_ms("first token") == 8.0 and view.stage_ms("stream") == 4.0
    assert view.current_stage() == "stream" and view.output_tokens() == (5, "chunks")


def _run_headless(monkeypatch, keys_after_done: tuple[str, ...] = ("q",)) -> None:
    """Make the CLI believe it is on a terminal and run the endpoint explorer headless under a pilot."""
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    original = EndpointApp.run

    async def drive(pilot) -> None:
        app = pilot.app
        await wait_for(pilot, lambda: app.view.result is not None or app.load_error is not None, timeout=60)
        await pilot.press(*keys_after_done)

    monkeypatch.setattr(EndpointApp, "run", lambda self: original(self, headless=True, auto_pilot=drive))


def test_the_cli_opens_the_endpoint_explorer_on_a_terminal(served, monkeypatch, capsys):
    _run_headless(monkeypatch)
    code = main(["--base-url", served.v1, "--api-key", KEY, "--max-tokens", "5", "--temperature", "0", "Hi"])
    err = capsys.readouterr().err
    assert code == 0, err
    line = err.strip().splitlines()[-1]
    # The request's own id, sent as X-Request-Id, which reqscope serve keeps as the request's.
    assert line.startswith("reqscope: req-") and "length: 5 tokens in" in line and "TTFT" in line


def test_the_cli_reports_a_refused_key_as_one_line_and_exit_code_1(served, monkeypatch, capsys):
    _run_headless(monkeypatch)
    code = main(["--base-url", served.v1, "--api-key", "wrong", "Hi"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("reqscope: error: ") and "refused the API key" in err
    assert "Traceback" not in err


async def _foreign_stream(request):
    """A server that is not reqscope's: 3 tokens per chunk, usage at the end, no logprobs, no timing report."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(4):
        await asyncio.sleep(0.05)
        chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i}a w{i}b w{i}c "}, "finish_reason": None}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}
    await response.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
    return response


async def test_a_foreign_server_without_logprobs_or_a_report_is_drawn_honestly():
    foreign = web.Application()
    foreign.router.add_post("/v1/chat/completions", _foreign_stream)
    server = start_in_thread(foreign, "127.0.0.1", 0)  # no /v1/models: the model must be named
    try:
        target = EndpointTarget(server.url + "/v1", model="foreign")
        app = EndpointApp(target, request(), settings=settings(top_logprobs=3))
        async with app.run_test(size=LARGE) as pilot:
            await finished(pilot, app)
            result = app.view.result
            assert (result.output_tokens, result.output_tokens_source, result.chunks) == (12, "usage", 4)
            assert "output 12/12 tokens (usage) in 4 chunks · 3.00 tokens per chunk" in screen_text(app, "#tokens")
            assert "returned no logprobs" in screen_text(app, "#logits")
            latency = screen_text(app, "#latency")
            m = result.metrics
            assert m.tpot_ms == pytest.approx((m.e2e_ms - m.ttft_ms) / 11)
            assert m.itl.mean > 2.5 * m.tpot_ms  # 3 tokens a chunk: a chunk's gap spans three tokens' time
            assert f"TPOT       {m.tpot_ms:.2f} ms" in latency and f"ITL mean   {m.itl.mean:.2f} ms" in latency
            assert "the server sent no timing report" in latency
            assert "none reported" in screen_text(app, "#timeline")
            assert "model foreign" in screen_text(app, "#status")
            # Asked for but none came back; and with no request without them yet, no cost to measure.
            assert "no request without them this session to compare" in latency
    finally:
        server.stop()


async def test_settings_not_given_show_as_the_servers_default(served):
    app = endpoint_app(served, settings=RequestSettings())
    async with app.run_test(size=LARGE) as pilot:
        await finished(pilot, app)
        result = app.view.result
        assert result.error is None and app.view.sent.settings == RequestSettings()
        status = screen_text(app, "#status")
        assert "sampling: server default" in status and "logprobs" not in status
        answer = screen_text(app, "#tokens")
        assert f"output {result.output_tokens} tokens (usage)" in answer and "max tokens: server default" in answer
        logprobs = screen_text(app, "#logits")
        assert "server default for all (temperature, top_k, top_p, min_p, seed, max_tokens)" in logprobs
        assert "logprobs off: not asked for, so they cannot slow the server being measured" in logprobs
        assert "--logprobs N on the command line, or o, logprobs N, then r" in logprobs
        assert app.view.token_logprobs == []  # none asked, none sent
        latency = screen_text(app, "#latency")
        assert "logprobs" not in latency  # nothing asked, nothing disturbed, nothing to say
        # reqscope serve's report: its TTFT and its TPOT beside the client's.
        assert result.tpot is not None and result.tpot.source == "reqscope"
        assert "TPOT: client clock vs server clock" in latency
        assert f"server     {result.tpot.server_ms:.2f} ms" in latency


async def test_asking_for_logprobs_says_so_and_measures_the_cost_against_a_request_without(served):
    app = endpoint_app(served)  # no logprobs: the baseline
    async with app.run_test(size=LARGE) as pilot:
        await finished(pilot, app)
        baseline = app.view.result.metrics.tpot_ms
        assert "logprobs off" in screen_text(app, "#logits")
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, EndpointSettingsForm))
        assert app.screen.query_one("#field-top_logprobs", Input).value == ""  # off
        app.screen.query_one("#field-top_logprobs", Input).value = "3"
        await pilot.click("#apply")
        await wait_for(pilot, lambda: app.next_settings is not None)
        upcoming = "next: T 0 (greedy) max 12 · k p min-p seed: server default, logprobs top 3"
        assert upcoming in screen_text(app, "#status")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.settings.logprobs)
        await finished(pilot, app)
        assert all(len(entry.top) == 3 for entry in app.view.token_logprobs)
        assert len(app.view.token_logprobs) == TOKENS
        status = screen_text(app, "#status")
        assert "#2" in status and "logprobs top 3: may slow the server" in status
        with_ = app.view.result.metrics.tpot_ms
        latency = screen_text(app, "#latency")
        assert (f"logprobs cost: TPOT {with_:.2f} ms with them vs {baseline:.2f} ms without (#1): "
                f"{with_ - baseline:+.2f} ms/token") in latency
        assert "asking for logprobs can slow the server" in screen_text(app, "#logits")


def test_the_settings_form_reads_blank_as_the_servers_default():
    assert parse_settings({}) == RequestSettings()
    values = {"temperature": "0.5", "top_k": " ", "max_tokens": "7", "top_logprobs": "0"}
    assert parse_settings(values) == RequestSettings(temperature=0.5, max_tokens=7, top_logprobs=0)
    assert settings_values(RequestSettings(temperature=0.5, seed=3))["seed"] == "3"
    assert settings_values(RequestSettings())["top_logprobs"] == ""
    for bad, message in (({"top_k": "x"}, "top-k must be a whole number or blank"),
                         ({"max_tokens": "0"}, "max tokens must be at least 1"),
                         ({"top_logprobs": "-1"}, "logprobs must be 0 or more")):
        with pytest.raises(RequestError, match=message):
            parse_settings(bad)


async def test_a_bad_field_in_the_settings_form_is_named_and_nothing_changes(served):
    app = endpoint_app(served)
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, EndpointSettingsForm))
        app.screen.query_one("#field-temperature", Input).value = "warm"
        await pilot.click("#apply")
        await pilot.pause()
        assert isinstance(app.screen, EndpointSettingsForm) and app.next_settings is None
        assert "temperature must be a number or blank; got 'warm'" in screen_text(app, "#form-error")


LLAMA_TIMINGS = {"cache_n": 4, "prompt_n": 6, "prompt_ms": 8.25, "prompt_per_token_ms": 1.375,
                 "prompt_per_second": 727.27, "predicted_n": 4, "predicted_ms": 46.0,
                 "predicted_per_token_ms": 11.5, "predicted_per_second": 86.96}


async def _llama_stream(request):
    """A server shaped like llama.cpp's: a token a chunk, `timings` with the last chunk."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for word in ("one", " two", " three", " four"):
        await asyncio.sleep(0.02)
        chunk = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}, "timings": LLAMA_TIMINGS}
    await response.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
    return response


async def test_llama_cpp_timings_are_drawn_as_the_servers_view():
    llama = web.Application()
    llama.router.add_post("/v1/chat/completions", _llama_stream)
    server = start_in_thread(llama, "127.0.0.1", 0)
    try:
        app = EndpointApp(EndpointTarget(server.url + "/v1", model="llama"), request(), settings=RequestSettings())
        async with app.run_test(size=LARGE) as pilot:
            await finished(pilot, app)
            result = app.view.result
            assert result.timings is not None and result.tpot.source == "timings"
            latency = screen_text(app, "#latency")
            assert "llama.cpp timings (server clock)" in latency
            assert "prompt     8.2 ms" in latency and "prompt tok 6 (+4 cached)" in latency
            assert "per token  11.50 ms" in latency and "generated  4" in latency
            assert f"client TTFT {result.metrics.ttft_ms:.1f} ms: " in latency
            assert "TPOT: client clock vs server clock" in latency
            assert f"client     {result.tpot.client_ms:.2f} ms" in latency and "server     11.50 ms" in latency
            timeline = screen_text(app, "#timeline")
            assert "own clock (llama.cpp timings)" in timeline
            assert "prompt                      8.25  6 tokens" in timeline
            assert "generation                 46.00  4 tokens" in timeline
    finally:
        server.stop()


async def test_an_endpoint_export_replays_in_the_explorer_with_the_servers_view(served, tmp_path, capsys):
    folder = tmp_path / "run"
    argv = ["--base-url", served.v1, "--api-key", KEY, "--json", "--export", str(folder), "--max-tokens", "5",
            "--temperature", "0", "Hi"]
    code = await asyncio.to_thread(main, argv)  # the CLI runs its own event loop
    captured = capsys.readouterr()
    assert code == 0, captured.err
    done = next(json.loads(line) for line in captured.out.splitlines() if json.loads(line)["event"] == "done")
    header, events = read_endpoint_trace(folder / ENDPOINT_TRACE)
    assert header.url == served.v1 and isinstance(events[0], RequestSent) and events[0].messages[-1].content == "Hi"
    result = next(e.result for e in events if isinstance(e, StreamEnded))
    assert result.chunks == done["chunks"] and result.metrics.ttft_ms == pytest.approx(done["metrics"]["ttft_ms"])
    view = result.server_view
    assert view.kind.name == "reqscope" and view.request_id == done["server_view"]["request_id_sent"]
    assert view.ttft_split.source == "reqscope serve report" and done["server_view"]["ttft_split"]["joined"]
    app = EndpointApp.replaying(header, events)
    async with app.run_test(size=LARGE) as pilot:
        await wait_for(pilot, lambda: app.view.result is not None and not app.needs_repaint)
        latency = screen_text(app, "#latency")
        assert f"TTFT {view.ttft_split.client_ttft_ms:.1f} ms (client) split by the server: reqscope serve" in latency
        assert app.state == "length" and "Hi" in screen_text(app, "#tokens")
        await pilot.press("r")  # a replay sends nothing
        assert app.worker is None


async def test_x_exports_the_request_on_screen_for_replay(served, tmp_path):
    app = endpoint_app(served, export_root=tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        await pilot.press("x")
        assert app.last_export is not None and app.last_export.parent.parent == tmp_path
        header, events = read_endpoint_trace(app.last_export)
        assert events == app.view.events and header.model == app.model
