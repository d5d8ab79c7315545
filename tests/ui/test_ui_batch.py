"""The explorer's request inside the batch: the batch panel, the readout's batch item, and the load
the explorer puts on its own engine (--background, --serve-port), driven with Textual's Pilot."""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import replace

import pytest
from test_ui import panel_text
from ui_fixtures import (
    SOLO_STEP_MS,
    TRACE,
    TRACE_NAME,
    background_threads,
    batched_events,
    batched_replay_app,
    finished,
    held_at,
    kyoto_request,
    live_app,
    replay_app,
    wait_for,
)

from minengine.engine.batch_facts import BatchStep
from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PreemptEvent, PrefillEvent, TokenEvent
from minengine.kv.arithmetic import MIB
from minengine.kv.usage import PoolUsage
from minengine.record.export import TRACE_JSONL, export_run
from minengine.record.trace_io import read_trace
from reqscope.engine_load import SOLO_STEPS, LoadOptions
from reqscope.ui.help_screen import HelpScreen
from reqscope.ui.run.panels.batch import pool_cells
from reqscope.ui.run.replay_app import ReplayExplorer
from reqscope.ui.run.view import RunView

pytestmark = pytest.mark.anyio

SMALL = (80, 24)
MEDIUM = (120, 40)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def own_engine(chatty_tiny_dir):
    """An engine of this test's own: serving it replaces its scheduler, which no other test must see."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)


# -- snapshots -----------------------------------------------------------------------------------


def test_batched_step_small(snap_compare):
    # Token 6 of the batched run: its step shared with 3 others and another request's prefill chunk.
    assert snap_compare(batched_replay_app(), press=["s"] * 6 + ["6"], terminal_size=SMALL)


def test_batched_step_medium(snap_compare):
    # The finished run: the pool bar, both prefill chunks, the preemption, the recent steps' charts.
    assert snap_compare(batched_replay_app(), press=["end", "6"], terminal_size=MEDIUM)


def test_batched_run_wide(snap_compare):
    # Every panel at once: the batch panel is a strip under the grid.
    assert snap_compare(batched_replay_app(), press=["end"], terminal_size=(160, 50))


# -- the panel over a replay ---------------------------------------------------------------------


async def test_the_batch_panel_reads_the_step_on_screen():
    _, events = batched_events()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    app = batched_replay_app()
    async with app.run_test(size=MEDIUM) as pilot:
        await pilot.press("end", "6")
        await pilot.pause()
        text = panel_text(app, "#batch")
        last = tokens[-1].batch
        assert f"step {last.step} (token {len(tokens)}): 4 sequences (3 others)" in text
        assert "4 decode + 0 prefill tokens · queue" in text
        assert f"{last.step_ms:.1f} ms · alone {SOLO_STEP_MS:.1f} ms → {last.step_ms / SOLO_STEP_MS:.2f}×" in text
        pool = last.pool
        assert f"this request {pool.own / MIB:.2f} MiB" in text and f"free {pool.free / MIB:.2f} MiB" in text
        assert "prefill 2 chunks: 0–18 in step 40 (3 seq) · 19–37 in step 41 (4 seq)" in text
        assert "preempted after token 9" in text and "3 blocks" in text
        result = next(e for e in events if isinstance(e, DoneEvent)).result
        assert f"whole run {result.batch.steps} steps, {result.batch.shared_steps} shared" in text
        assert "batch 4" in panel_text(app, "#readout")
        # Back to token 6: its step had another request's prefill chunk (96 tokens) in it.
        for _ in range(6):
            await pilot.press("b")
        await pilot.pause()
        text = panel_text(app, "#batch")
        assert "step 46 (token 6): 4 sequences (3 others) · 3 decode + 96 prefill tokens" in text
        assert "so far" in text and "preempted never" in text


async def test_a_run_alone_has_no_batch_panel_and_key_6_says_why():
    app = replay_app()
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("end", "6")
        await pilot.pause()
        assert app.compact_view == "logits" and not app.screen.query_one("#batch").display
        assert "batch" not in panel_text(app, "#readout")
        assert "6 batch" not in app.query_one("#logits").border_subtitle
        await pilot.press("question_mark")
        assert "Show the batch panel" not in panel_text(app, "HelpScreen Static")


async def test_a_batched_replay_offers_the_panel_everywhere():
    app = batched_replay_app()
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("5", "v")  # after the template: the batch panel, in turn with the others
        await pilot.pause()
        assert app.compact_view == "batch" and app.screen.query_one("#batch").display
        assert app.query_one("#batch").border_subtitle.endswith("6 batch")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "Show the batch panel" in panel_text(app, "HelpScreen Static")


def test_the_pool_bar_keeps_every_held_part_visible():
    pool = PoolUsage(budget=1000 * MIB, own=1, others=MIB, prefix=0)
    assert pool_cells(pool, 40) == [1, 1, 0, 38]
    assert sum(pool_cells(PoolUsage(100, 50, 30, 20), 7)) == 7
    assert pool_cells(PoolUsage(100, 50, 25, 0), 8) == [4, 2, 0, 2]


def test_a_view_is_batched_only_when_the_request_shared_the_engine():
    _, events = batched_events()
    assert RunView.of(events).batched
    alone = BatchStep(3, 1, 1, 0, 0, 20.0, 20.0, PoolUsage(100, 10, 0, 0))
    solo = [replace(e, batch=alone) if isinstance(e, TokenEvent) and e.index else e
            for e in events if not isinstance(e, PreemptEvent | PrefillEvent)]  # fmt: skip
    assert not RunView.of(solo).batched
    _, recorded = read_trace(TRACE)  # before the engine batched: no facts at all
    assert not RunView.of(recorded).batched


def test_export_and_replay_keep_the_batch_facts(tmp_path):
    header, events = batched_events()
    result = next(e for e in events if isinstance(e, DoneEvent)).result
    export_run(result, tmp_path, events, header)
    again_header, again = read_trace(tmp_path / TRACE_JSONL)
    assert again == events and again_header == header
    assert ReplayExplorer(again_header, again, source_name=TRACE_NAME)._batched()


# -- live: load on the explorer's own engine -----------------------------------------------------


async def test_background_requests_run_beside_the_explorers_and_stop_with_it(own_engine):
    app = live_app(own_engine, kyoto_request(max_tokens=96), load=LoadOptions(background=2))
    async with app.run_test(size=SMALL) as pilot:
        await wait_for(pilot, lambda: len(background_threads()) == 2 or app.view.result is not None)
        await pilot.press("2")  # the explorer answers its keys while the others run
        assert app.compact_view == "kv" and app.screen.query_one("#kv").display
        await pilot.press("6")
        await finished(pilot, app)
        assert app.compact_view == "batch"  # what the load is for: the panel it shows
        text = panel_text(app, "#batch")
        assert "engine shared with 2 background requests" in text
        assert "+2 background" in panel_text(app, "#status")
        steps = [t.batch for t in app.view.tokens if t.batch is not None]
        # Its first decode steps ran alone (SOLO_STEPS), then the others joined its steps.
        assert [s.sequences for s in steps[:SOLO_STEPS]] == [1] * SOLO_STEPS
        assert max(s.sequences for s in steps) > 1 and app.view.shared_steps > 0
        assert all(s.solo_step_ms for s in steps[SOLO_STEPS:])
        assert f"whole run {app.view.result.batch.steps} steps, {app.view.result.batch.shared_steps} shared" in text
        load = app.load
        assert load is not None and load.background.count == 2
        await wait_for(pilot, lambda: not background_threads())  # they stop with the user's request
        assert load.background.sent >= 2 and load.background.failed == 0, load.background.last_error
        sent, first = load.background.sent, app.view.result.request_id
        await pilot.press("r")  # a new run brings them back
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
        assert load.background.sent >= sent + 2
    assert not background_threads()  # quitting ends them


async def test_a_held_request_does_not_hold_the_background_ones(own_engine):
    app = live_app(own_engine, kyoto_request(max_tokens=8), start_paused=True, load=LoadOptions(background=1))
    async with app.run_test(size=SMALL) as pilot:
        await held_at(pilot, app, 0)
        load = app.load
        assert load is not None
        await wait_for(pilot, lambda: load.background.finished >= 2, timeout=120)  # while the user's is held
        assert app.held_step == 0 and len(app.view.tokens) == 0
        await pilot.press("space")
        await finished(pilot, app)
    assert not background_threads()


def _chat(url: str, model: str, content: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


async def test_the_explorer_serves_the_openai_api_from_its_engine(own_engine):
    app = live_app(own_engine, kyoto_request(max_tokens=24), start_paused=True, load=LoadOptions(serve_port=0))
    async with app.run_test(size=SMALL) as pilot:
        await held_at(pilot, app, 0)
        url = app.load.note.serve_url if app.load is not None else None
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert f"API {url}/v1" in panel_text(app, "#status")
        assert f"the OpenAI API at {url}/v1" in panel_text(app, "#batch")
        answers: list[dict] = []
        model = own_engine.model_dir.name
        client = threading.Thread(target=lambda: answers.append(_chat(url, model, "Hello", 4)))
        client.start()
        # Answered while the explorer's own request is held: it holds no step the client needs.
        await wait_for(pilot, lambda: not client.is_alive(), timeout=120)
        assert answers and answers[0]["usage"]["completion_tokens"] == 4
        assert app.held_step == 0
        await pilot.press("space")
        await finished(pilot, app)
        assert answers[0]["model"] == own_engine.model_dir.name
    with pytest.raises(OSError):  # the server went with the explorer, and its threads with it
        _chat(url, model, "Hello", 1)
    assert not [t for t in threading.enumerate() if t.name.startswith("reqscope-") and t.is_alive()
                and t.name != "reqscope-runs"]  # fmt: skip; the explorer's own run thread (`RunThread`)
