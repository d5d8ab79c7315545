"""Snapshots of the explorer's main layouts, drawn from the recorded trace (no clocks, no memory readings).

Sizes: 80x24 (the smallest supported), 140x45 (an ordinary terminal: one detail panel, tall),
160x50 and 200x50 (every panel at once). The readout line is on screen at each.
"""

from __future__ import annotations

from textual.widgets import Input
from ui_fixtures import held_replay_app, replay_app, roofline_replay_app

SMALL = (80, 24)
MEDIUM = (140, 45)
LARGE = (160, 50)
WIDE = (200, 50)


def test_step_mode_logits_small(snap_compare):
    assert snap_compare(replay_app(), press=["s", "s", "s"], terminal_size=SMALL)


def test_kv_cache_small(snap_compare):
    assert snap_compare(replay_app(), press=["s", "s", "s", "s", "s", "2"], terminal_size=SMALL)


def test_gqa_vs_mha_small(snap_compare):
    assert snap_compare(replay_app(), press=["end", "3"], terminal_size=SMALL)


def test_latency_small(snap_compare):
    assert snap_compare(replay_app(), press=["end", "4"], terminal_size=SMALL)


def test_chat_template_small(snap_compare):
    assert snap_compare(replay_app(), press=["s", "5"], terminal_size=SMALL)


def test_every_panel_large_mid_run(snap_compare):
    assert snap_compare(replay_app(), press=["s"] * 6, terminal_size=LARGE)


def test_every_panel_large_finished(snap_compare):
    assert snap_compare(replay_app(), press=["end"], terminal_size=LARGE)


def test_held_step_latency_small(snap_compare):
    # Held 2.5 s at step 6: the readout and the latency panel show the engine's ITL, the held time apart.
    assert snap_compare(held_replay_app(at=5), press=["s"] * 8 + ["4"], terminal_size=SMALL)


def test_mid_run_medium(snap_compare):
    assert snap_compare(replay_app(), press=["s"] * 6, terminal_size=MEDIUM)


def test_kv_growth_medium(snap_compare):
    assert snap_compare(replay_app(), press=["end", "2"], terminal_size=MEDIUM)


def test_held_step_latency_medium(snap_compare):
    assert snap_compare(held_replay_app(at=5), press=["s"] * 9 + ["4"], terminal_size=MEDIUM)


def test_every_panel_wide_mid_run(snap_compare):
    assert snap_compare(replay_app(), press=["s"] * 6, terminal_size=WIDE)


def test_every_panel_wide_finished(snap_compare):
    assert snap_compare(replay_app(), press=["end"], terminal_size=WIDE)


def test_roofline_latency_small(snap_compare):
    # A trace that kept each step's bytes and the machine's read ceiling: the roofline line above the ITLs.
    assert snap_compare(roofline_replay_app(), press=["end", "4"], terminal_size=SMALL)


def test_roofline_latency_medium(snap_compare):
    assert snap_compare(roofline_replay_app(), press=["end", "4"], terminal_size=MEDIUM)


def test_help_screen(snap_compare):
    assert snap_compare(replay_app(), press=["question_mark"], terminal_size=SMALL)


def test_recorded_step_refiltered_with_lower_top_p(snap_compare):
    async def lower_top_p(pilot):
        await pilot.press("s", "o")
        await pilot.pause()
        pilot.app.screen.query_one("#field-top_p", Input).value = "0.5"
        await pilot.click("#apply")
        await pilot.pause()

    assert snap_compare(replay_app(), run_before=lower_top_p, terminal_size=(100, 30))


def test_no_color(snap_compare, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = replay_app()
    assert app.no_color
    assert snap_compare(app, press=["end"], terminal_size=SMALL)
