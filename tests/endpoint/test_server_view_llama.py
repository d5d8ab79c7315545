"""The endpoint client's view of a request inside a real llama-server, end to end.

Against llama.cpp's llama-server on the default GGUF (4 slots, `--metrics`), the client must hold
the server's own view beside its own: `prompt_progress` placing the prompt on the client's clock,
its `timings` splitting TTFT, the batch and the slots polled while the request runs, the
template's tokens checked against the usage; the explorer must send twice on one client (the
server closes each stream's connection); a server without `--metrics` gets the line that names it.
"""

from __future__ import annotations

import json

import pytest
from peers import LLAMA_SERVER_SCRIPT, default_gguf, llama_server, llama_server_binary
from ui_fixtures import panel_text, wait_for

from minengine.engine.request import GenerationRequest
from reqscope.cli import main
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.ui.endpoint.app import EndpointApp

if llama_server_binary() is None or default_gguf() is None:
    pytest.skip(f"llama-server or the default GGUF not provisioned: run {LLAMA_SERVER_SCRIPT}", allow_module_level=True)

PROMPT = "Name three colors and say one thing about each."


@pytest.fixture(scope="module")
def root():
    with llama_server("-np", "4", "-c", "8192", "-b", "64", "--metrics") as url:
        yield url


def test_json_carries_llama_servers_view_reconciled_with_the_clients(root, capsys):
    code = main(["--base-url", root + "/v1", "--json", "--poll-ms", "50", "--max-tokens", "48", "--temperature", "0",
                 PROMPT])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    records = [json.loads(line) for line in captured.out.splitlines()]
    done = next(r for r in records if r["event"] == "done")
    view, prompt_tokens = done["server_view"], done["usage"]["prompt_tokens"]
    assert view["server"]["name"] == "llama-server" and view["off"] == []
    # Its progress through the prompt, every update before the first token.
    progress = [r for r in records if r["event"] == "progress"]
    first_chunk = next(r for r in records if r["event"] == "chunk")
    assert progress and progress[-1]["total"] == progress[-1]["processed"] == prompt_tokens
    assert all(p["t_ms"] <= first_chunk["t_ms"] for p in progress)
    # The batch, with the slots: this request took one of the four.
    batch = [r for r in records if r["event"] == "batch"]
    assert batch and all(r["source"] == "llama-server /metrics + /slots" for r in batch)
    assert all(len(r["slots"]) == 4 for r in batch) and any(s["processing"] for r in batch for s in r["slots"])
    # TTFT split: the prompt's start on the client's clock (from the progress), its time, delivery.
    split = done["server_view"]["ttft_split"]
    assert split["source"] == "llama-server timings + prompt_progress" and not split["joined"]
    assert split["prefill_first_token_ms"] == pytest.approx(done["server_timings"]["prompt_ms"])
    parts = (split["connection_http_ms"], split["prefill_first_token_ms"], split["delivery_ms"])
    assert sum(parts) == pytest.approx(split["client_ttft_ms"], abs=0.01) and split["clock_note"] is None
    assert split["client_ttft_ms"] == pytest.approx(done["metrics"]["ttft_ms"])
    # The server's template and tokens, as many as its usage counted.
    assert len(view["prompt"]["token_ids"]) == prompt_tokens
    assert view["prompt"]["source"].startswith("llama-server /apply-template") and view["prompt"]["text"]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_explorer_sends_twice_and_draws_the_slots_and_tokens(root):
    target = EndpointTarget(root + "/v1", poll_ms=50)
    app = EndpointApp(target, GenerationRequest.from_prompt(PROMPT),
                      settings=RequestSettings(temperature=0, max_tokens=24))
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.view.result is not None, timeout=60)
        first = app.view
        await pilot.press("r")  # the second request: llama-server closed the first one's connection
        await wait_for(pilot, lambda: app.view is not first and app.view.result is not None, timeout=60)
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert first.error is None and app.view.error is None, app.view.error
        assert app.query_one("#body").has_class("-server-strip")
        batch, template = panel_text(app, "#batch"), panel_text(app, "#template")
        assert "slots: " in batch and "llama-server /metrics + /slots every 50 ms" in batch
        assert f"= usage.prompt_tokens {app.view.result.usage.prompt_tokens} ✓" in template
        assert "<|im_start|>" in template


def test_a_server_without_metrics_gets_the_line_that_names_the_flag(capsys):
    with llama_server("-np", "1") as url:
        code = main(["--base-url", url + "/v1", "--plain", "--max-tokens", "8", "--temperature", "0", "Hi"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "off       the batch (requests processing, deferred): off; start llama-server with --metrics" in err
    assert "batch     " in err and "llama-server /slots" in err  # /slots is on by default: the slots still show
