"""The rooflines in the latency panel, driven with Textual's Pilot: decode's memory roofline over a trace
that kept it, and prefill's compute roofline beside it in a real run of the default model."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from textual.widgets import Static
from ui_fixtures import (
    RECORDED_CEILING,
    RECORDED_WEIGHT_BYTES,
    finished,
    kyoto_request,
    live_app,
    replay_app,
    roofline_replay_app,
)

from minengine.engine.events import TokenEvent
from minengine.engine.roofline import ComputeCeiling, prefill_attention_flops, prefill_flops
from minengine.kv.arithmetic import MIB
from minengine.plan.compute_ceiling import prefill_path_name
from reqscope.bench.ceiling import CALIBRATE_HINT, COMPUTE_HINT, machine_name, save_ceiling, save_compute_ceiling

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _latency(app) -> str:
    widget = app.screen.query_one("#latency")
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()


@pytest.mark.parametrize("size", [(80, 24), (140, 45)])
async def test_the_latency_panel_sets_the_latest_step_against_the_ceiling(size):
    app = roofline_replay_app()
    async with app.run_test(size=size) as pilot:
        await pilot.press("end", "4")
        await pilot.pause()
        last = [t for t in app.view.tokens if isinstance(t, TokenEvent)][-1]
        total = RECORDED_WEIGHT_BYTES + 46_080 * last.kv.tokens  # the seeds' formula: 2 x 30 x 3 x 64 x 4 a position
        allowed = total / RECORDED_CEILING.bytes_per_s * 1000
        text = _latency(app)
        expected = (f"roofline   step {last.index + 1} read {total / MIB:.1f} MiB: {allowed:.1f} ms at 16.1 GB/s, "
                    f"took {last.step_ms:.1f} ms = {allowed / last.step_ms:.0%}")  # fmt: skip
        assert expected in text, text
        if size == (140, 45):  # room for what fewer bytes buy, and where the ceiling came from
            steps = [t for t in app.view.tokens if t.index]
            mean = sum(RECORDED_WEIGHT_BYTES + 46_080 * t.kv.tokens for t in steps) / len(steps)
            half = RECORDED_CEILING.bytes_per_s / (mean - RECORDED_WEIGHT_BYTES / 2)
            now = RECORDED_CEILING.bytes_per_s / mean
            assert f"memory-bound: ½ the weight bytes → {half:.1f} tok/s at the ceiling ({now:.1f} now)" in text, text
            assert f"weights {RECORDED_WEIGHT_BYTES / mean:.1%} of the bytes" in text
            assert "ceiling    reqscope calibrate, 2026-12-01 09:55 UTC · sum over 512 MiB" in text
        assert "ITL" in text  # the chart keeps its place


async def test_without_a_ceiling_the_panel_shows_the_bytes_and_says_so():
    app = roofline_replay_app(ceiling=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("end", "4")
        await pilot.pause()
        text = _latency(app)
        steps = [t for t in app.view.tokens if t.index]
        mean = sum(RECORDED_WEIGHT_BYTES + 46_080 * t.kv.tokens for t in steps) / len(steps)
        assert "roofline   step 12 read " in text
        assert f"(weights {RECORDED_WEIGHT_BYTES / mean:.1%}) · no read ceiling in this trace" in text


async def test_an_older_trace_draws_no_roofline():
    async with replay_app().run_test(size=(140, 45)) as pilot:
        await pilot.press("end", "4")
        await pilot.pause()
        assert "roofline" not in _latency(pilot.app)


@pytest.mark.parametrize("stored", [True, False])
async def test_a_live_run_reads_this_machines_ceiling(chatty_engine, read_ceiling_file, stored):
    from dataclasses import replace

    if stored:
        save_ceiling(replace(RECORDED_CEILING, machine=machine_name(chatty_engine.device)), read_ceiling_file)
    app = live_app(chatty_engine, kyoto_request(max_tokens=6))
    async with app.run_test(size=(140, 45)) as pilot:
        await pilot.press("4")
        await finished(pilot, app)
        assert (app.header.read_ceiling is not None) is stored
        text = _latency(app)
        last = app.view.tokens[-1]
        assert f"roofline   step {last.index + 1} read {last.bytes_read.total / MIB:.1f} MiB" in text
        if stored:
            assert "at 16.1 GB/s, took " in text and "ceiling    reqscope calibrate, 2026-12-01 09:55 UTC" in text
        else:
            assert f"no read ceiling for this machine: {CALIBRATE_HINT}" in text


# -- prefill's compute roofline, beside decode's memory roofline ----------------------------------------

COMPUTE_FLOPS = 50e9  # a compute ceiling kept for the machine and the model's path (the figures are the run's)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_a_real_run_shows_prefills_compute_roofline_beside_decodes_memory_roofline(default_engine, size):
    from dataclasses import replace

    machine = machine_name(default_engine.device)
    save_ceiling(replace(RECORDED_CEILING, machine=machine))
    save_compute_ceiling(ComputeCeiling(COMPUTE_FLOPS, 256, "30 layers' projections over 256 rows, fastest of 5 passes",
                                        machine, prefill_path_name(default_engine), "2026-12-01 09:56 UTC",
                                        "reqscope calibrate"))  # fmt: skip
    app = live_app(default_engine, kyoto_request(max_tokens=6))
    async with app.run_test(size=size) as pilot:
        await pilot.press("4")
        await finished(pilot, app)
        text = _latency(app)
        prefill, shape = app.view.prefill, app.header.flop_shape
        computed = prefill.prompt_tokens - prefill.reused_tokens
        flops = prefill_flops(shape, computed, prefill.reused_tokens)  # the formula the hand count holds
        per_s = flops / (prefill.duration_ms / 1000)
        rows = max((c.tokens for c in prefill.chunks), default=computed)
        per_row = 2 * (shape.layer_params + shape.head_params) / shape.weight_bytes  # FLOPs a weight byte, a row
        crossover = COMPUTE_FLOPS / RECORDED_CEILING.bytes_per_s / per_row
        cross = f"{crossover:.{1 if crossover < 10 else 0}f}"
        if size == (120, 40):  # the compute line, then the crossover, each in full
            assert (f"compute    prefill {flops / computed / 1e9:.3g} GFLOP/token, {per_s / 1e9:.1f} GFLOP/s = "
                    f"{per_s / COMPUTE_FLOPS:.0%} of 50.0 GFLOP/s") in text, text  # fmt: skip
            assert f"crossover  compute binds from ~{cross} rows a step; this step: {rows} rows" in text, text
            share = prefill_attention_flops(shape, computed, prefill.reused_tokens) / flops
            assert f" · attention {share:.0%} of the FLOPs" in text, text  # after the fraction, where it fits
        else:  # both in one line
            assert (f"compute    {flops / computed / 1e9:.3g} GF/token · {per_s / 1e9:.1f} GF/s = "
                    f"{per_s / COMPUTE_FLOPS:.0%} · binds from ~{cross} rows, step {rows}") in text, text  # fmt: skip
        last = app.view.tokens[-1]
        assert f"roofline   step {last.index + 1} read {last.bytes_read.total / MIB:.1f} MiB: " in text, text
        assert text.index("compute    ") < text.index("roofline   step")  # prefill's, then decode's


async def test_without_a_compute_ceiling_the_prefill_shows_its_flops_and_says_what_to_run(chatty_engine):
    app = live_app(chatty_engine, kyoto_request(max_tokens=4))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("4")
        await finished(pilot, app)
        text = _latency(app)
        assert "compute    prefill " in text and " GFLOP/token, " in text
        assert f"compute ceiling not measured: run {COMPUTE_HINT}" in text, text
        assert "where compute binds needs both ceilings" in text
