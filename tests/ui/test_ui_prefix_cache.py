"""The prefix cache in the explorer: the pipeline stage, reused prompt tokens, shared blocks, TTFT hit vs miss."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from textual.widgets import Static
from ui_fixtures import finished, kyoto_request, live_app, replay_app, wait_for

from minengine.engine.events import PrefillEvent, PrefixCacheEvent, PromptEvent, StageEvent
from minengine.kv.usage import KVUsage
from minengine.plan.service_model import LineFit, ServiceModel
from minengine.record.trace_io import TraceHeader
from minengine.sampling.params import SamplingParams
from minengine.text.prompt_parts import PromptPart
from minengine.text.tokenizer import TokenPiece
from reqscope.ui.run.figures.latency import RunTtft, latency_figures, ttft_without_hit
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.panels.kv import shared_blocks_line
from reqscope.ui.run.panels.latency import LatencyPanel, predicted_prefill, prefix_cache_ttft
from reqscope.ui.run.panels.pipeline import PipelinePanel, prefix_cache_cell, stage_label
from reqscope.ui.run.panels.tokens import REUSED_STYLE, TokensPanel, prompt_style, reused_legend
from reqscope.ui.run.view import PIPELINE, PIPELINE_WITHOUT_PREFIX_CACHE, RunView

SMOLLM = TraceHeader("SmolLM2-135M-Instruct", "", layers=30, q_heads=9, kv_heads=3, head_dim=64,
                     dtype="float32", device="cpu", load_ms=0.0)


def kv_usage(tokens: int) -> KVUsage:
    per_token = 2 * 30 * 3 * 64 * 4
    blocks = -(-tokens // 16)
    return KVUsage(
        layout="gqa", dtype="float32", tokens=tokens, block_size=16, blocks=blocks, layers=30, stored_heads=3,
        head_dim=64, bytes_per_token=per_token, logical_bytes=per_token * tokens,
        physical_bytes=per_token * 16 * blocks, reserved_bytes=per_token * 64, per_layer_tokens=(tokens,) * 30,
        per_layer_logical_bytes=(per_token // 30 * tokens,) * 30,
        per_layer_physical_bytes=(per_token // 30 * 16 * blocks,) * 30,
    )


def cache_event(hit: int = 2, looked_up: int = 2, prompt: int = 38, enabled: bool = True) -> PrefixCacheEvent:
    return PrefixCacheEvent(enabled=enabled, prompt_tokens=prompt, block_size=16, blocks_looked_up=looked_up,
                            blocks_hit=hit, reused_tokens=16 * hit, lookup_ms=0.1, copy_ms=0.4, duration_ms=2.5,
                            kept_blocks=3, kept_bytes=3 << 20)


def hit_view(hit: int = 2, prefill_done: bool = True) -> RunView:
    """A run up to its prefill, the prefix cache having supplied `hit` of the prompt's 2 full blocks."""
    view = RunView()
    for i, name in enumerate(("gateway", "template", "tokenize", "admit")):
        view.apply(StageEvent(name, i, i + 1))
    pieces = tuple(TokenPiece(i, f"t{i}", i == 0, i, i + 1) for i in range(38))
    view.apply(PromptEvent("".join(p.text for p in pieces), pieces, (PromptPart("user", 38),)))
    view.apply(StageEvent("prefix_cache", 4.0, 6.5, f"{hit} of 2 blocks hit, {16 * hit} of 38 prompt tokens reused"))
    view.apply(cache_event(hit))
    if prefill_done:
        view.apply(StageEvent("prefill", 6.5, 30.0))
        view.apply(PrefillEvent(38, 23.5, kv_usage(38), reused_tokens=16 * hit))
    return view


def frame_of(view: RunView, **options) -> Frame:
    return Frame(header=SMOLLM, view=view, request_id="req-2", max_tokens=8, params=SamplingParams(),
                 state="running", replay=False, latency=latency_figures(view), **options)


def plain(renderable, width: int = 200) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


# -- the fold and the pipeline ---------------------------------------------------------------------


def test_the_pipeline_has_the_prefix_cache_stage_between_admit_and_prefill():
    assert PIPELINE.index("prefix_cache") == PIPELINE.index("admit") + 1 == PIPELINE.index("prefill") - 1
    view = hit_view(prefill_done=False)
    assert view.current_stage() == "prefill" and view.reused_tokens == 32
    assert view.pipeline() == PIPELINE
    running = RunView.of([StageEvent(n, i, i + 1) for i, n in enumerate(("gateway", "template", "tokenize", "admit"))])
    assert running.current_stage() == "prefix_cache"


def test_an_old_trace_without_the_stage_draws_the_old_pipeline():
    view = RunView.of([StageEvent("admit", 0, 1), StageEvent("prefill", 1, 5), PrefillEvent(10, 4.0, kv_usage(10))])
    assert view.pipeline() == PIPELINE_WITHOUT_PREFIX_CACHE and "prefix_cache" not in view.pipeline()
    assert view.reused_tokens == 0


def test_pipeline_cell_shows_duration_and_blocks_hit_as_room_allows():
    event = cache_event(21, 21)
    assert prefix_cache_cell("3.4ms", event, "", 20) == "3.4ms 21/21 hit"
    assert prefix_cache_cell("3.4ms", event, "", 13) == "3.4ms 21/21"
    assert prefix_cache_cell("3.4ms", event, "", 8) == "3.4ms"
    assert prefix_cache_cell("0.1ms", None, "off", 16) == "0.1ms off"
    assert prefix_cache_cell("0.1ms", cache_event(enabled=False), "", 7) == "off"
    assert [stage_label("prefix_cache", w) for w in (16, 12, 8)] == ["prefix cache", "pfx cache", "cache"]
    assert stage_label("prefill", 8) == "prefill"


def test_pipeline_panel_draws_the_hit():
    text = plain(PipelinePanel().draw(frame_of(hit_view()), 160, 2))
    assert "prefix cache" in text and "2.5ms 2/2 hit" in text


# -- tokens, KV, latency ---------------------------------------------------------------------------


def test_reused_prompt_tokens_are_marked():
    assert prompt_style(False, True) == REUSED_STYLE
    assert prompt_style(True, True) == f"reverse {REUSED_STYLE}"
    assert prompt_style(True, False) == "reverse" and prompt_style(False, False) == ""
    assert reused_legend(0, 38) is None
    assert reused_legend(32, 38).plain == "prompt 32 reused from the prefix cache, 6 prefilled"
    drawn = TokensPanel().draw(frame_of(hit_view()), 200, 12)
    lines = list(drawn.renderables)
    assert "32 reused from the prefix cache" in lines[1].plain
    # the chips for tokens 0..31 carry the reused style, those from 32 on do not
    styled = {line.plain[s.start : s.end] for line in lines[2:] for s in line.spans if REUSED_STYLE in str(s.style)}
    assert styled == {f"t{i}{i}" for i in range(32)}  # a chip is its piece then its id


def test_kv_shows_shared_and_new_blocks():
    line = shared_blocks_line(cache_event(2), kv_usage(41))
    assert line.plain.startswith("blocks 2 shared (from the prefix cache) + 1 new · 2/2 hit")
    miss = shared_blocks_line(cache_event(0), kv_usage(41))
    assert miss.plain.startswith("blocks 0 shared (no prefix cache hit) + 3 new")
    assert shared_blocks_line(None, kv_usage(41)) is None
    assert shared_blocks_line(cache_event(enabled=False), kv_usage(41)) is None


def test_ttft_with_the_hit_beside_the_earlier_run_without_one():
    history = (RunTtft("req-0", 38, 0, 300.0), RunTtft("req-1", 50, 0, 400.0), RunTtft("req-2", 38, 32, 100.0))
    assert ttft_without_hit(history, "req-2", 38) == history[0]
    assert ttft_without_hit(history, "req-0", 38) is None
    view = hit_view()
    fig = latency_figures(view)
    assert fig.reused_tokens == 32 and fig.computed_tokens == 6
    lines = [t.plain for t in prefix_cache_ttft(fig, "req-2", history)]
    assert lines[0].startswith("TTFT hit") and "32 of 38 tokens cached" in lines[0]
    assert lines[1].startswith("TTFT miss  300.0 ms  the earlier run")
    assert "no earlier run" in prefix_cache_ttft(fig, "req-2", ())[1].plain
    text = plain(LatencyPanel().draw(frame_of(view, ttft_history=history, prefill_history=((38, 90.0), (6, 23.5))),
                                     120, 30))
    assert "prefill    23.5 ms for 6 of 38 tokens (32 cached)" in text
    assert "prefill by tokens computed: 38 tok 90.0 ms · 6 tok 23.5 ms" in text


def test_predicted_prefill_from_a_service_model_beside_the_measured():
    service = ServiceModel("m", "cpu", "float32", prefill=LineFit(10.0, 2.0, 0.99), decode=LineFit(5.0, 0.0, 0.9),
                           points=())
    fig = latency_figures(hit_view())
    expected = "fit        predicted prefill 22.0 ms (fit) vs measured 23.5 ms for 6 tokens"
    assert predicted_prefill(service, fig).plain == expected
    text = plain(LatencyPanel().draw(frame_of(hit_view(), service_model=service), 120, 30))
    assert "predicted prefill 22.0 ms (fit) vs measured 23.5 ms" in text


# -- live, through the app -------------------------------------------------------------------------

@pytest.fixture
def anyio_backend():
    return "asyncio"


def panel_text(app, selector: str) -> str:
    widget = app.screen.query_one(selector)
    return plain(widget.content if isinstance(widget, Static) else widget.render(), 300)


@pytest.mark.anyio
async def test_restarting_the_same_prompt_hits_the_prefix_cache(chatty_engine):
    app = live_app(chatty_engine, kyoto_request(max_tokens=2))
    async with app.run_test(size=(160, 50)) as pilot:
        await finished(pilot, app)
        first = app.view.result.request_id
        prompt = app.view.prefix_cache.prompt_tokens
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
        await finished(pilot, app)
        event = app.view.prefix_cache
        assert event is not None and event.blocks_hit == event.blocks_looked_up == (prompt - 1) // 16 > 0
        assert app.view.prefill.reused_tokens == event.reused_tokens == app.view.result.usage.cached_tokens > 0
        hit = f"{event.blocks_hit}/{event.blocks_looked_up} hit"
        assert "prefix cache" in panel_text(app, "#pipeline") and hit in panel_text(app, "#pipeline")
        assert f"prompt {event.reused_tokens} reused from the prefix cache" in panel_text(app, "#tokens")
        assert f"blocks {event.blocks_hit} shared (from the prefix cache)" in panel_text(app, "#kv")
        latency = panel_text(app, "#latency")
        assert "TTFT hit" in latency and f"{event.reused_tokens} of {prompt} tokens cached" in latency
        assert app.history.prefill[-1][0] == prompt - event.reused_tokens
        assert app.history.ttft[-1].reused_tokens == event.reused_tokens


@pytest.mark.anyio
async def test_an_old_trace_replays_without_the_stage():
    app = replay_app()
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.press("end")
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert app.view.prefix_cache is None and app.view.reused_tokens == 0
        assert "prefix cache" not in panel_text(app, "#pipeline")
        assert "reused from the prefix cache" not in panel_text(app, "#tokens")


# -- --service-model -------------------------------------------------------------------------------


def test_the_run_flag_reads_a_fit_and_refuses_a_bad_file(tmp_path, capsys):
    from reqscope.cli import build_parser
    from reqscope.run_options import ModelFolder
    from reqscope.ui.launch import launch_explorer

    args = build_parser("run").parse_args(["--service-model", str(tmp_path / "fit.json"), "hi"])
    assert args.service_model == str(tmp_path / "fit.json")
    (tmp_path / "fit.json").write_text("{}")
    assert launch_explorer(args, kyoto_request(), ModelFolder.of(args)) == 1  # before any engine or screen
    assert "is not a service model" in capsys.readouterr().err
