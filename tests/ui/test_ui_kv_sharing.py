"""The KV panel's split of the request's blocks: its own, shared with other requests, shared with
the prefix cache; live at 80x24 (a prefix cache hit, a second request sharing the prefix), in the
words that fit, and kept through export and replay (an older trace draws no split)."""

from __future__ import annotations

import pytest
from test_ui import panel_text
from ui_fixtures import TRACE, finished, kyoto_request, live_app, replay_app, wait_for

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PrefixCacheEvent, TokenEvent
from minengine.kv.usage import BlockSharing
from minengine.record.export import TRACE_JSONL, export_run
from minengine.record.trace_io import read_trace, trace_header
from reqscope.engine_load import SOLO_STEPS, LoadOptions
from reqscope.ui.run.panels.kv import block_split_line
from reqscope.ui.run.replay_app import ReplayExplorer

SMALL = (80, 24)
BLOCK = 2 * 30 * 3 * 64 * 4 * 16  # one 16-token block of SmolLM2-135M's float32 K/V


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def own_engine(chatty_tiny_dir):
    """A fresh engine: its prefix cache starts empty, and no other test's runs are in it."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)


def split(app) -> BlockSharing:
    sharing = app.view.kv.sharing
    assert sharing is not None
    return sharing


def split_words(s: BlockSharing) -> str:
    return (f"blocks {s.blocks}: {s.own} own · {s.with_requests} shared with other requests"
            f" · {s.with_prefix} with the prefix cache")  # fmt: skip


# -- the line ------------------------------------------------------------------------------------


def test_the_split_line_words_what_fits():
    s = BlockSharing(9, 3, 0, BLOCK)
    assert block_split_line(s, 120).plain == ("blocks 12: 9 own (6.33 MiB) · 3 shared with other requests (2.11 MiB)"
                                              " · 0 with the prefix cache")  # fmt: skip
    assert block_split_line(s, 73).plain == "blocks 12: 9 own · 3 shared with other requests · 0 with the prefix cache"
    assert block_split_line(s, 72).plain == "blocks 12: 9 own · 3 with requests · 0 with prefix cache"
    assert block_split_line(s, 46).plain == "blocks 12: 9 own · 3 others · 0 prefix"
    assert block_split_line(s, 20).cell_len == 20  # cut, never wrapped
    assert block_split_line(None, 120) is None  # a cache outside the pool, an older trace


# -- live, at 80x24 ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_prefix_cache_hit_shows_as_blocks_shared_with_the_prefix_cache(own_engine):
    app = live_app(own_engine, kyoto_request(max_tokens=4))
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        await pilot.press("2")
        first, alone = app.view.result.request_id, split(app)
        assert alone.with_requests == alone.with_prefix == 0 and alone.own == app.view.kv.blocks > 0
        assert split_words(alone) in panel_text(app, "#kv")
        await pilot.press("r")  # the same prompt again: its full blocks come from the prefix cache
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
        await finished(pilot, app)
        hit = app.view.prefix_cache.blocks_hit
        s = split(app)
        assert hit > 0 and s.with_prefix == hit and s.with_requests == 0 and s.blocks == app.view.kv.blocks
        assert split_words(s) in panel_text(app, "#kv")


@pytest.mark.anyio
async def test_a_request_sharing_the_prefix_shows_as_blocks_shared_with_other_requests(own_engine):
    list(own_engine.start(kyoto_request(max_tokens=2, request_id="warm")))  # the prefix cache keeps the prompt
    other = own_engine.start(kyoto_request(max_tokens=3, request_id="other"))
    events = iter(other)
    for event in events:  # up to its first token, then held there: it keeps the shared blocks
        if isinstance(event, TokenEvent):
            other.hold()
            break
    app = live_app(own_engine, kyoto_request(max_tokens=4))
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        await pilot.press("2")
        hit = app.view.prefix_cache.blocks_hit
        s = split(app)
        assert hit > 0 and s.with_requests == hit and s.with_prefix == 0 and s.own == app.view.kv.blocks - hit
        assert split_words(s) in panel_text(app, "#kv")
    assert isinstance(list(events)[-1], DoneEvent)


@pytest.mark.anyio
async def test_background_requests_share_the_template_block_with_a_restarted_run(own_engine):
    # Every request's chat template starts with the same system prompt: its first full block is
    # in the prefix cache once a run has ended, and the background requests attach it too.
    app = live_app(own_engine, kyoto_request(max_tokens=32), load=LoadOptions(background=2))
    async with app.run_test(size=SMALL) as pilot:
        await finished(pilot, app)
        first = app.view.result.request_id
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
        await finished(pilot, app)
        await pilot.press("2")
        hit = app.view.prefix_cache.blocks_hit
        splits = [t.kv.sharing for t in app.view.tokens]
        assert hit > 1 and all(s.with_requests + s.with_prefix == hit and s.blocks == s.own + hit for s in splits)
        assert [s.with_requests for s in splits[:SOLO_STEPS]] == [0] * SOLO_STEPS  # alone until they join
        assert any(s.with_requests for s in splits)
        assert split_words(splits[-1]) in panel_text(app, "#kv")


# -- export and replay ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_export_and_replay_keep_the_split(own_engine, tmp_path):
    list(own_engine.start(kyoto_request(max_tokens=2, request_id="warm")))
    events = list(own_engine.start(kyoto_request(max_tokens=3)))
    hit = next(e for e in events if isinstance(e, PrefixCacheEvent)).blocks_hit
    export_run(events[-1].result, tmp_path, events, trace_header(own_engine))
    header, again = read_trace(tmp_path / TRACE_JSONL)
    tokens = [e.kv.sharing for e in again if isinstance(e, TokenEvent)]
    assert tokens == [e.kv.sharing for e in events if isinstance(e, TokenEvent)]
    assert hit > 0 and all(s.with_prefix == hit for s in tokens)
    app = ReplayExplorer(header, again, source_name=TRACE_JSONL)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("end", "2")
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert split_words(tokens[-1]) in panel_text(app, "#kv")


@pytest.mark.anyio
async def test_an_older_trace_replays_without_the_split():
    _, events = read_trace(TRACE)
    assert all(e.kv.sharing is None for e in events if isinstance(e, TokenEvent))
    app = replay_app()
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("end", "2")
        await wait_for(pilot, lambda: not app.needs_repaint)
        text = panel_text(app, "#kv")
        assert "tokens" in text and " own" not in text and "shared with other requests" not in text
