"""The step's inside on screen (issue 22): the attention panel (7) and the logit lens panel (8).

Replays of a run recorded with both views (`INSPECT_TRACE`), and live runs on the default model:
the keys switch panels, the grid brackets GQA's groups and `m` shows MHA's, a held step shows its
full view, a hidden panel turns capture off, and an older trace says it has none.
"""

from __future__ import annotations

import pytest
from test_ui import panel_text
from ui_fixtures import (
    INSPECT_TRACE,
    finished,
    held_at,
    inspect_replay_app,
    kyoto_request,
    live_app,
    replay_app,
    wait_for,
)

from minengine.engine.events import TokenEvent
from minengine.inspect.ask import NOTHING
from minengine.record.trace_io import read_trace
from reqscope.ui.run.inside.cached_tokens import kind_label, origin, position_piece
from reqscope.ui.run.inside.focus import AttentionFocus
from reqscope.ui.run.panels.attention import cell_glyph
from reqscope.ui.run.panels.lens import first_top

pytestmark = pytest.mark.anyio

SMALL = (80, 24)
MEDIUM = (120, 40)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _recorded_tokens() -> list[TokenEvent]:
    _, events = read_trace(INSPECT_TRACE)
    return [e for e in events if isinstance(e, TokenEvent)]


# -- the records as the panels read them -----------------------------------------------------------


def test_cells_grow_with_the_weight_on_the_top_position():
    assert [cell_glyph(w) for w in (0.05, 0.2, 0.4, 0.6, 0.9, 1.0)] == ["·", "░", "▒", "▓", "█", "█"]


def test_the_focus_cycles_layers_and_heads_through_the_mean():
    focus = AttentionFocus()
    assert focus.shown_layer == 0 and focus.head is None
    assert focus.moved_layer(-1, 30).layer == 29
    heads = [focus := focus.moved_head(1, 3) for _ in range(4)]
    assert [f.head for f in heads] == [0, 1, 2, None]
    assert AttentionFocus(40, 12).clamped(30, 9) == AttentionFocus(29, 8)


def test_positions_are_named_by_where_their_token_came_from():
    app = inspect_replay_app()
    app.recording.to_end()
    view = app.recording.view()
    prompt = len(view.prompt.pieces)
    assert position_piece(view, 0) == "<|im_start|>" and kind_label(origin(view, 0)) == "template"
    user = view.prompt.token_parts.index("user")
    assert kind_label(origin(view, user)) == "prompt"
    assert position_piece(view, prompt) == view.tokens[0].piece and kind_label(origin(view, prompt)) == "output"


def test_the_lens_marks_the_first_layer_whose_top_guess_is_the_chosen_token():
    for token in _recorded_tokens():
        lens = token.inspection.lens
        first = first_top(lens)
        ranks = [layer.chosen_rank for layer in lens.layers]
        assert first == (ranks.index(1) if 1 in ranks else None)
        assert lens.layers[-1].chosen_rank == 1 or token.trace.chosen_id != lens.layers[-1].top_token


# -- replay ----------------------------------------------------------------------------------------


async def test_keys_7_and_8_show_the_recorded_views_and_the_grid_groups_gqa_heads():
    app = inspect_replay_app()
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("s", "s", "7")
        await pilot.pause()
        assert app.compact_view == "attention"
        text = panel_text(app, "#attention")
        assert "gqa 9 q heads / 3 KV" in text and "step 3 · recorded" in text
        # 9 query heads over 3 stored K/V heads: three brackets of three
        assert [line.split()[0] for line in text.splitlines() if line.lstrip().startswith("kv")] == ["kv0", "kv1",
                                                                                                   "kv2"]
        assert text.count("┬") == 3 and text.count("├") == 3 and text.count("└") == 3
        pending = app.recording.pending_token()
        mean_top = pending.inspection.attention.layers[0].mean_top[0]
        assert f"{mean_top.weight:6.1%}" in text
        assert "v next" in app.query_one("#attention").border_subtitle
        assert "7 attn  8 lens" in app.query_one("#attention").border_subtitle

        await pilot.press("8")
        await pilot.pause()
        lens = pending.inspection.lens
        text = panel_text(app, "#lens")
        assert f"top-1 from layer {first_top(lens)}" in text and "◀ first top-1" in text
        assert f"over the step's {lens.candidates} likeliest tokens only" in text


async def test_the_layer_and_head_keys_move_the_detail():
    app = inspect_replay_app()
    async with app.run_test(size=MEDIUM) as pilot:
        await pilot.press("s", "7", "right_square_bracket", "right_square_bracket", "right_curly_bracket",
                          "right_curly_bracket")
        await pilot.pause()
        assert app.inside_focus == AttentionFocus(2, 1)
        head = app.recording.pending_token().inspection.attention.layers[2].heads[1]
        text = panel_text(app, "#attention")
        assert f"layer 2 · head 1 (kv 0) · H {head.entropy:.2f} nats" in text
        assert f"{head.top[0].weight:6.1%}" in text
        await pilot.press("left_curly_bracket", "left_curly_bracket")
        await pilot.pause()
        assert "layer 2 · mean of 9 heads" in panel_text(app, "#attention")


async def test_an_older_trace_says_plainly_it_has_no_inside_views():
    app = replay_app()
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("s", "7")
        await pilot.pause()
        assert app.compact_view == "logits"
        assert "attention" not in app._detail_views() and "lens" not in app._detail_views()
        notes = [n.message for n in app._notifications]
        assert any("this trace has no attention records" in m for m in notes)
        await pilot.press("8")
        await pilot.pause()
        assert any("this trace has no logit lens records" in n.message for n in app._notifications)


# -- live, on the default model ----------------------------------------------------------------------


async def test_a_hidden_panel_captures_nothing_and_a_shown_one_captures_each_step(default_engine):
    app = live_app(default_engine, kyoto_request(max_tokens=6), start_paused=True)
    async with app.run_test(size=SMALL) as pilot:
        await held_at(pilot, app, 0)
        assert app.shown.run._ask == NOTHING and app.shown.run._held_ask is None
        await pilot.press("s")
        await held_at(pilot, app, 1)
        assert app.view.tokens[-1].inspection is None  # nothing on screen asked for it
        await pilot.press("7")
        await pilot.pause()
        assert app.shown.run._ask.attention and app.shown.run._ask.lens is None
        # step 1's logits were computed before the panel showed; the forward behind step 2 is captured
        await pilot.press("s")
        await held_at(pilot, app, 2)
        assert app.view.tokens[-1].inspection is None
        await pilot.press("s")
        await held_at(pilot, app, 3)
        captured = app.view.tokens[-1].inspection
        assert captured is not None and captured.attention is not None and captured.lens is None
        assert not captured.on_demand and captured.cost.step_ms > 0
        await pilot.press("1")  # the logits panel again: capture stops from the next forward on
        await pilot.pause()
        assert app.shown.run._ask == NOTHING
        await pilot.press("space")
        await finished(pilot, app)
        assert all(t.inspection is None for t in app.view.tokens[4:])


async def test_a_held_step_shows_its_full_view(default_engine):
    app = live_app(default_engine, kyoto_request(max_tokens=4), start_paused=True)
    async with app.run_test(size=MEDIUM) as pilot:
        await held_at(pilot, app, 0)
        await pilot.press("8")
        await wait_for(pilot, lambda: app.shown.inspection() is not None)
        shown = app.shown.inspection()
        assert shown.inspection.on_demand and shown.inspection.lens.basis == "vocab"
        text = panel_text(app, "#lens")
        assert "step 1 waiting · full view" in text and "softmax over all 49152 tokens, rank among them" in text
        assert "inspecting: +" in text and "ms for this view" in text
        await pilot.press("7")
        await wait_for(pilot, lambda: (s := app.shown.inspection()) is not None and s.inspection.attention is not None)
        text = panel_text(app, "#attention")
        assert "step 1 waiting · full view" in text and "(every position)" in text
        await pilot.press("space")
        await finished(pilot, app)
        text = panel_text(app, "#attention")
        assert "committed" in text and "ms/step" in text


async def test_m_shows_the_same_grid_under_mha(default_engine):
    app = live_app(default_engine, kyoto_request(max_tokens=3), start_paused=True)
    async with app.run_test(size=MEDIUM) as pilot:
        await held_at(pilot, app, 0)
        await pilot.press("7")
        await wait_for(pilot, lambda: app.shown.inspection() is not None)
        assert "gqa 9 q heads / 3 KV" in panel_text(app, "#attention")
        await pilot.press("m")
        await wait_for(pilot, lambda: app.request.kv_layout == "mha" and app.held_step == 0)
        await wait_for(pilot, lambda: app.shown.inspection() is not None)
        await wait_for(pilot, lambda: not app.needs_repaint)
        text = panel_text(app, "#attention")
        assert "mha 9 q heads / 9 KV" in text
        # every query head its own K/V head: nine unbracketed rows
        assert [line.split()[0] for line in text.splitlines() if line.lstrip().startswith("kv")] == [
            f"kv{i}" for i in range(9)]
        assert "┬" not in text and text.count("─ h") == 9
        await pilot.press("space")
        await finished(pilot, app)


# -- snapshots -------------------------------------------------------------------------------------


def test_attention_small(snap_compare):
    assert snap_compare(inspect_replay_app(), press=["s", "s", "7"], terminal_size=SMALL)


def test_attention_medium(snap_compare):
    assert snap_compare(inspect_replay_app(), press=["s", "s", "s", "7", "right_square_bracket"],
                        terminal_size=MEDIUM)


def test_lens_small(snap_compare):
    assert snap_compare(inspect_replay_app(), press=["s", "s", "8"], terminal_size=SMALL)


def test_lens_medium(snap_compare):
    assert snap_compare(inspect_replay_app(), press=["s", "s", "s", "8"], terminal_size=MEDIUM)


def test_inside_views_wide(snap_compare):
    assert snap_compare(inspect_replay_app(), press=["s", "s", "s"], terminal_size=(160, 50))


async def test_an_exported_run_replays_the_views_it_captured(chatty_engine, tmp_path):
    from minengine.record.export import TRACE_JSONL
    from reqscope.ui.run.replay_app import ReplayExplorer

    app = live_app(chatty_engine, kyoto_request(max_tokens=6), start_paused=True, export_root=tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await held_at(pilot, app, 0)
        await pilot.press("7", "space")
        await finished(pilot, app)
        await pilot.press("x")
        await wait_for(pilot, lambda: app.last_export is not None)
        captured = [t.index for t in app.view.tokens if t.inspection is not None]
    header, events = read_trace(app.last_export / TRACE_JSONL)
    assert [e.index for e in events if isinstance(e, TokenEvent) and e.inspection is not None] == captured
    replay = ReplayExplorer(header, events)
    async with replay.run_test(size=SMALL) as pilot:
        await pilot.press(*["s"] * captured[0], "7")  # the replay opens on step 1, token 0 pending
        await pilot.pause()
        assert replay.compact_view == "attention"
        assert f"step {captured[0] + 1} · recorded" in panel_text(replay, "#attention")
        await pilot.press("8")  # the lens was not on screen: the trace has none
        await pilot.pause()
        assert replay.compact_view == "attention"
        assert any("no logit lens records" in n.message for n in replay._notifications)


# -- inside a batch ----------------------------------------------------------------------------------


async def test_inside_a_batch_the_views_are_the_requests_own_row(chatty_tiny_dir):
    from minengine.engine.engine import Engine
    from reqscope.engine_load import LoadOptions

    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)
    app = live_app(engine, kyoto_request(max_tokens=48), load=LoadOptions(background=2))
    async with app.run_test(size=MEDIUM) as pilot:
        await pilot.press("7")
        await finished(pilot, app)
        prompt = len(app.view.prompt.pieces)
        shared = [t for t in app.view.tokens if t.batch is not None and t.batch.sequences > 1 and t.inspection]
        assert shared, "no captured step shared the engine"
        for token in shared:  # its own query and its own cache, whatever else the step ran
            attention = token.inspection.attention
            assert (attention.query_position, attention.context) == (prompt + token.index - 1, prompt + token.index)
            assert all(a.position < attention.context for layer in attention.layers for a in layer.mean_top)
        last = app.view.tokens[-1]
        assert f"query at {last.inspection.attention.query_position} over" in panel_text(app, "#attention")
