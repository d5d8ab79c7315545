"""The explorer's batch panel on the pages real servers sent (tests/endpoint/recorded_server.py), through Pilot.

The whole endpoint explorer runs against the replay: it detects the server, streams the recorded
chat answer (a chunk every 30 ms) and polls the recorded batch every 50 ms, which goes from idle
through three other clients' streams. The panel's figures must be those of the pages the replay
served: its "now" line the last poll's page, its peaks the highest any served page showed, its
slots llama-server's last /slots page. The live tests (test_server_view_*.py) draw it from the
running servers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from recorded_server import RecordedPage, Replay, load_recording, replaying, serving
from ui_fixtures import panel_text, wait_for

from minengine.engine.request import GenerationRequest
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.ui.endpoint.app import EndpointApp

PROMPT = "Name three colors."  # the request the recordings answered
POLL_MS = 50.0


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _value(page: RecordedPage, name: str) -> float:
    values = [s.value for f in text_string_to_metric_families(page.body) for s in f.samples if s.name == name]
    return sum(values) / len(values) if name.endswith("_perc") else sum(values)


async def _run(replay: Replay, size: tuple[int, int] = (160, 48)) -> tuple[EndpointApp, str]:
    """Run the explorer against the replay until the request has ended; the batch panel's text."""
    app = EndpointApp(EndpointTarget(replay.v1, poll_ms=POLL_MS), GenerationRequest.from_prompt(PROMPT),
                      settings=RequestSettings(temperature=0, max_tokens=12))  # fmt: skip
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.view.result is not None, timeout=60)
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert app.view.error is None, app.view.error
        return app, panel_text(app, "#batch").replace("\u00a0", " ")


def _batch_pages(replay: Replay, route: str, samples: int) -> list[RecordedPage]:
    """The pages the explorer's samples were read from: the served ones after detection's own read
    (vLLM's /metrics), in order (a poll still in flight as the stream ended was served, never drawn)."""
    served = replay.served_polls(route)
    skip = 1 if route == "/metrics" else 0
    return [s.page for s in served[skip : skip + samples]]


@pytest.mark.anyio
async def test_vllms_batch_panel_draws_the_pages_it_polled():
    with replaying("vllm") as replay:
        app, text = await _run(replay)
        samples = app.view.batch
        pages = _batch_pages(replay, "/metrics", len(samples))
    assert len(samples) >= 3 and len(pages) == len(samples)
    last = pages[-1]
    now = (f"now: running {_value(last, 'vllm:num_requests_running'):.0f} · "
           f"waiting {_value(last, 'vllm:num_requests_waiting'):.0f} · "
           f"KV {_value(last, 'vllm:kv_cache_usage_perc'):.1%}")  # fmt: skip
    assert now in text
    peak = max(_value(p, "vllm:num_requests_running") for p in pages)
    assert peak >= 1 and f"running at most {peak:.0f}" in text
    assert f"vLLM /metrics every {POLL_MS:.0f} ms: {len(samples)} reads" in text
    assert "running " in text and "KV %" in text  # the sparklines, from two polls on
    assert "not read" not in text and "no reading yet" not in text


@pytest.mark.anyio
async def test_llama_servers_batch_panel_draws_its_slots():
    with replaying("llama-server") as replay:
        app, text = await _run(replay)
        samples = app.view.batch
        slots = _batch_pages(replay, "/slots", len(samples))
        metrics = _batch_pages(replay, "/metrics", len(samples))
    assert len(samples) >= 3 and len(slots) == len(samples)
    shown = []
    for raw in slots[-1].json():
        if raw["is_processing"]:
            shown.append(f"{raw['id']}:task {raw['id_task']} {raw['next_token'][0]['n_decoded']} out")
        else:
            shown.append(f"{raw['id']}:idle")
    assert "slots: " + "  ".join(shown) in text
    assert f"now: running {_value(metrics[-1], 'llamacpp:requests_processing'):.0f}" in text
    assert f"llama-server /metrics + /slots every {POLL_MS:.0f} ms: {len(samples)} reads" in text


@pytest.mark.anyio
async def test_llama_server_without_metrics_draws_its_slots_and_names_the_flag():
    with replaying("llama-server-no-metrics") as replay:
        app, text = await _run(replay)
    assert app.view.batch and all(s.source == "llama-server /slots" for s in app.view.batch)
    assert "slots: 0:" in text
    assert "start llama-server with --metrics" in text


@pytest.mark.anyio
async def test_a_server_whose_batch_cannot_be_read_says_so():
    """llama-cpp-python's server has none of the routes: the panel names why it shows nothing."""
    with replaying("llama-cpp-python") as replay:
        app = EndpointApp(EndpointTarget(replay.v1, poll_ms=POLL_MS), GenerationRequest.from_prompt(PROMPT),
                          settings=RequestSettings(temperature=0, max_tokens=12))  # fmt: skip
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: app.view.server is not None, timeout=60)
            await wait_for(pilot, lambda: not app.needs_repaint)
            text = panel_text(app, "#batch")
    assert "unknown server: its batch is not readable (vLLM and llama-server expose one)" in text
    asked = [s.route for s in replay.served]
    assert asked.count("/metrics") == 1 and "/slots" not in asked  # detection's read only: never polled


@pytest.mark.anyio
async def test_a_refused_chat_ends_in_its_error_and_the_panels_still_draw():
    """llama-server's pages with its chat route answering 404: the request ends in the server's
    error, and every panel draws (the template panel once failed on a result without usage)."""
    recording = replace(load_recording("llama-server"), post={})
    with serving(recording) as replay:
        app = EndpointApp(EndpointTarget(replay.v1, poll_ms=POLL_MS), GenerationRequest.from_prompt(PROMPT),
                          settings=RequestSettings(temperature=0, max_tokens=12))  # fmt: skip
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: app.view.result is not None, timeout=60)
            await wait_for(pilot, lambda: not app.needs_repaint)
            template, batch = panel_text(app, "#template"), panel_text(app, "#batch")
    assert app.view.error is not None and "404" in app.view.error
    assert "this server does not say which tokens it used" in template
    assert "reading the server's batch" not in batch
