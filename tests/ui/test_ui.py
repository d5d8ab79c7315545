"""The explorer driven with Textual's Pilot: live runs of the real default model, and replays."""

from __future__ import annotations

import io
import re
import threading

import pytest
from rich.console import Console
from textual.widgets import Input, Log, Static, TextArea
from ui_fixtures import TRACE, finished, held_at, kyoto_request, live_app, replay_app, wait_for

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, TokenEvent
from minengine.errors import ModelNotFoundError
from minengine.record.export import METRICS_JSON, TRACE_JSONL
from minengine.record.trace_io import read_trace
from minengine.sampling.params import SamplingParams
from minengine.sampling.trace import explain_candidates
from reqscope.cli import build_parser, main
from reqscope.run_options import DEFAULT_PROMPT, ModelFolder, open_engine, request_from_args
from reqscope.ui.help_screen import HelpScreen
from reqscope.ui.keys import keys_for
from reqscope.ui.panel import Panel
from reqscope.ui.prompt_form import PromptForm
from reqscope.ui.run.app import RunExplorer
from reqscope.ui.run.figures.latency import latency_figures
from reqscope.ui.run.live_app import LiveExplorer
from reqscope.ui.run.loading_screen import LoadingScreen
from reqscope.ui.run.panels.readout import short_ms
from reqscope.ui.run.replay_app import ReplayExplorer
from reqscope.ui.run.sampling_form import SamplingForm

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def panel_text(app: RunExplorer, selector: str) -> str:
    """What a widget on the current screen draws, as plain text."""
    widget = app.screen.query_one(selector)
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()


def kept_ids(trace) -> list[int]:
    return [c.token_id for c in trace.candidates if c.dropped_by is None]


def top_p_rule(trace, top_p: float) -> list[int]:
    """Hugging Face's top-p rule on the ranked candidates: keep while the mass above is below top_p."""
    cands = trace.candidates
    return [c.token_id for i, c in enumerate(cands) if (cands[i - 1].cumulative if i else 0.0) < top_p]


async def set_sampling(pilot, app: RunExplorer, **fields: str) -> SamplingForm:
    """Open the sampling form and type `fields` into it (not applied yet)."""
    await pilot.press("o")
    await wait_for(pilot, lambda: isinstance(app.screen, SamplingForm))
    form = app.screen
    for name, value in fields.items():
        form.query_one(f"#field-{name}", Input).value = value
    await pilot.pause()
    return form


# -- live runs of the real default model ------------------------------------------------------


async def test_step_holds_after_each_token_and_space_runs_and_pauses(default_engine):
    app = live_app(default_engine, kyoto_request(max_tokens=6), start_paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await held_at(pilot, app, 0)
        assert app.view.prefill is not None and app.view.tokens == []
        assert "paused at step 1" in panel_text(app, "#status")
        await pilot.press("s")
        await held_at(pilot, app, 1)
        await pilot.press("s")
        await held_at(pilot, app, 2)
        await pilot.pause(0.3)
        assert len(app.view.tokens) == 2  # held: nothing decodes until asked

        await pilot.press("space", "space")  # run, then pause again at the next step
        await wait_for(pilot, lambda: app.held_step is not None or app.view.result is not None)
        if app.view.result is None:
            assert len(app.view.tokens) == app.held_step
        await pilot.press("space")
        await finished(pilot, app)
        assert app.view.result.finish_reason == "length"
        assert [t.index for t in app.view.tokens] == list(range(6))


async def test_a_held_step_is_shown_apart_from_the_engine_itl(default_engine):
    """Pause, wait 1.5 s, step: the latency panel's ITL stays the engine's, the pause shows as held."""
    app = live_app(default_engine, kyoto_request(max_tokens=256))  # still decoding when paused; leaving cancels it
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("4")  # the latency panel
        await wait_for(pilot, lambda: len(app.view.tokens) >= 6 or app.view.result is not None)
        await pilot.press("space")
        await wait_for(pilot, lambda: app.held_step is not None)
        free = latency_figures(app.view)
        assert free.held_ms == 0.0 and free.itl is not None
        await pilot.pause(1.5)
        step = app.held_step
        await pilot.press("s")
        await held_at(pilot, app, step + 1)
        fig = latency_figures(app.view)
        assert fig.held_ms >= 1400 and fig.wall_last_itl_ms >= 1400  # the wall clock saw the pause
        assert fig.last_itl_ms < 1000 and fig.itl.max < 1000  # the engine's ITL did not
        assert fig.last_itl_ms < fig.wall_last_itl_ms - 1400
        assert fig.engine.tpot_ms < free.itl.max + 1000 and fig.wall.tpot_ms > fig.engine.tpot_ms
        latency = panel_text(app, "#latency")
        assert f"last ITL   {fig.last_itl_ms:.1f} ms" in latency
        assert f"held by you {fig.held_ms / 1000:.2f} s" in latency
        assert f"wall clock, as a client saw it: last ITL {fig.wall_last_itl_ms:.1f} ms" in latency
        readout = panel_text(app, "#readout")
        assert re.search(rf"held( by you)? {fig.held_ms / 1000:.1f} ?s", readout), readout  # spelt to fit
        assert f"ITL last {short_ms(fig.last_itl_ms, ' ')}" in readout or f"ITL {short_ms(fig.last_itl_ms)}" in readout


@pytest.mark.parametrize("size", [(80, 24), (140, 45)])
async def test_the_readout_is_on_screen_while_decoding(default_engine, size):
    # Decoding still when checked: past any end of sequence, and far longer than the first paced
    # repaints take on a loaded machine (leaving the app cancels the run).
    app = live_app(default_engine, kyoto_request(max_tokens=2048, ignore_eos=True))
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: len(app.view.tokens) >= 4 and app.repaints > 1)
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert app.view.result is None  # still decoding
        readout = app.screen.query_one("#readout")
        assert readout.region.height == 1 and app.screen.region.contains_region(readout.region)
        text = panel_text(app, "#readout")
        for needle in ("tok", "TTFT", "ITL", "p50", "tok/s", "KV", "MiB", "gqa"):
            assert needle in text, text
        assert "held" not in text  # nobody paused this run


async def test_top_p_change_refilters_the_held_step_and_applies_to_the_next(default_engine):
    app = live_app(default_engine, kyoto_request(), start_paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await held_at(pilot, app, 0)
        before = app.subject.trace
        assert before.params.top_p == 0.9
        assert kept_ids(before) == top_p_rule(before, 0.9)

        form = await set_sampling(pilot, app, top_p="0.3")
        assert app.subject.trace.params.top_p == 0.3  # previewed while the form is open
        await pilot.click("#apply")
        await wait_for(pilot, lambda: app.screen is not form and not app.needs_repaint)
        after = app.subject.trace
        assert after.params.top_p == 0.3
        assert kept_ids(after) == top_p_rule(after, 0.3)
        assert len(kept_ids(after)) < len(kept_ids(before))
        assert "top-p 0.3" in panel_text(app, "#logits")

        await pilot.press("s")
        await held_at(pilot, app, 1)
        assert app.view.tokens[0].trace.params.top_p == 0.3
        assert app.view.tokens[0].token_id in kept_ids(after)


async def test_invalid_setting_is_refused_in_the_form(default_engine):
    app = live_app(default_engine, kyoto_request(), start_paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await held_at(pilot, app, 0)
        form = await set_sampling(pilot, app, top_p="1.5")
        await pilot.click("#apply")
        await pilot.pause()
        assert app.screen is form  # not applied
        assert "top_p must be in (0, 1]" in panel_text(app, "#form-error")
        await pilot.press("escape")
        assert app.sampling.params.top_p == 0.9


async def test_picking_a_candidate_commits_it_as_the_next_token(default_engine):
    app = live_app(default_engine, kyoto_request(), start_paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await held_at(pilot, app, 0)
        await pilot.press("down", "down", "down")
        assert app.cursor == 3
        pick = app.subject.trace.candidates[3]
        assert pick.token_id != app.subject.trace.chosen_id
        await pilot.press("enter")
        await held_at(pilot, app, 1)
        token = app.view.tokens[0]
        assert (token.token_id, token.forced) == (pick.token_id, True)
        assert token.trace.chosen_id == pick.token_id and token.trace.forced
        assert "⚑" in panel_text(app, "#tokens")


async def test_cancel_ends_the_request(default_engine):
    app = live_app(default_engine, kyoto_request(), start_paused=True)
    async with app.run_test() as pilot:
        await held_at(pilot, app, 0)
        await pilot.press("c")
        await finished(pilot, app)
        assert app.view.result.finish_reason == "cancelled"
        assert "cancelled" in panel_text(app, "#status")


async def test_switching_the_kv_layout_measures_both_layouts(default_engine):
    greedy = kyoto_request(max_tokens=4, sampling=SamplingParams(temperature=0))
    app = live_app(default_engine, greedy)
    async with app.run_test(size=(160, 50)) as pilot:
        await finished(pilot, app)
        gqa_ids = app.view.result.token_ids
        await pilot.press("m")
        await wait_for(pilot, lambda: app.request.kv_layout == "mha")
        await finished(pilot, app)
        assert app.view.result.token_ids == gqa_ids  # the layout changes bytes, not results
        h = app.header
        gqa, mha = app.history.measured["gqa"], app.history.measured["mha"]
        assert gqa.tokens == mha.tokens == app.view.kv.tokens
        assert mha.logical_bytes == gqa.logical_bytes * h.q_heads // h.kv_heads
        assert gqa.bytes_per_token == 2 * h.layers * h.kv_heads * h.head_dim * 4  # float32
        assert gqa.itl_mean_ms is not None and mha.itl_mean_ms is not None
        text = panel_text(app, "#layouts")
        assert "MHA/GQA bytes 3.00×" in text and "MQA" in text
        chart = panel_text(app, "#kv")  # the growth chart: this mha run, the gqa run measured before it
        assert "━ mha" in chart and "━ gqa " in chart and "┄ GQA" in chart


async def test_restart_runs_the_request_again_with_a_new_id(default_engine):
    app = live_app(default_engine, kyoto_request(max_tokens=2))
    async with app.run_test() as pilot:
        await finished(pilot, app)
        first = app.view.result.request_id
        await pilot.press("r")
        assert app.request.request_id != first
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
        assert app.view.result.usage.completion_tokens == 2


async def test_loading_and_every_run_share_one_run_thread(default_engine, monkeypatch):
    # The explorer's run thread (`RunThread`) loads and runs in order, never on the UI's thread;
    # the model work itself goes to the process's model thread (minengine.threads.ModelThread).
    threads: list[tuple[str, int]] = []
    start = Engine.start

    def recording_start(engine, request):
        threads.append(("run", threading.get_ident()))
        return start(engine, request)

    def open_engine(progress):
        threads.append(("load", threading.get_ident()))
        return default_engine

    monkeypatch.setattr(Engine, "start", recording_start)
    app = LiveExplorer(open_engine, kyoto_request(max_tokens=2))
    async with app.run_test() as pilot:
        await finished(pilot, app)
        first = app.view.result.request_id
        await pilot.press("r")
        await wait_for(pilot, lambda: app.view.result is not None and app.view.result.request_id != first)
    assert [what for what, _ in threads] == ["load", "run", "run"]
    assert len({ident for _, ident in threads}) == 1
    assert threading.get_ident() not in {ident for _, ident in threads}  # never the UI's thread


async def test_editing_the_system_prompt_and_prompt_runs_them(default_engine):
    app = live_app(default_engine, kyoto_request(max_tokens=1))
    async with app.run_test(size=(100, 30)) as pilot:
        await finished(pilot, app)
        await pilot.press("p")  # the prompt form, starting in the system prompt field
        await wait_for(pilot, lambda: isinstance(app.screen, PromptForm))
        app.screen.query_one("#system-input", Input).value = "You answer in French."
        app.screen.query_one("#prompt-input", TextArea).text = "Name one temple in Kyoto."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.view.prompt is not None and "French" in app.view.prompt.rendered)
        await finished(pilot, app)
        parts = {p.name: p.tokens for p in app.view.prompt.parts}
        assert parts["system"] > 0 and sum(parts.values()) == len(app.view.prompt.pieces)
        assert "Name one temple in Kyoto." in app.view.prompt.rendered
        assert [m.role for m in app.request.messages] == ["system", "user"]


async def test_kv_budget_error_is_shown_in_the_app_which_stays_usable(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=10_000)
    app = live_app(engine, kyoto_request())
    async with app.run_test(size=(80, 24)) as pilot:
        await finished(pilot, app)
        assert app.view.result.finish_reason == "error"
        error = app.query_one("#error")
        assert error.display
        assert "MiB of KV, budget" in panel_text(app, "#error")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("3")
        assert app.compact_view == "layouts"


async def test_engine_that_cannot_load_is_reported_on_the_loading_screen():
    def refuse(progress):
        progress("loading /nowhere")
        raise ModelNotFoundError("model folder /nowhere does not exist; pass --model PATH")

    app = LiveExplorer(refuse, kyoto_request())
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: app.load_error is not None)
        assert isinstance(app.screen, LoadingScreen)
        assert app.screen.query_one(Log).lines == ["loading /nowhere"]  # progress shown as it came
        assert "does not exist" in panel_text(app, "#loading-error")
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_loader_that_breaks_is_reported_not_a_silent_stall():
    def broken(progress):
        raise KeyError("lm_head.weight")

    app = LiveExplorer(broken, kyoto_request())
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: app.load_error is not None, timeout=10)
        assert app.load_error == "KeyError: 'lm_head.weight'"
        assert "lm_head.weight" in panel_text(app, "#loading-error")


# -- replays of the recorded trace ------------------------------------------------------------


async def test_replay_steps_forward_and_back():
    header, events = read_trace(TRACE)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    app = replay_app()
    async with app.run_test() as pilot:
        await pilot.pause()
        assert app.view.tokens == [] and app.view.prefill is not None
        assert app.subject.trace == tokens[0].trace  # the waiting step, as recorded
        await pilot.press("s", "s", "s")
        assert [t.token_id for t in app.view.tokens] == [t.token_id for t in tokens[:3]]
        await pilot.press("b")
        assert len(app.view.tokens) == 2
        assert app.subject.trace == tokens[2].trace
        await pilot.press("end")
        assert app.view.result is not None and len(app.view.tokens) == len(tokens)
        await pilot.press("home")
        assert app.view.tokens == []


async def test_replay_refilters_recorded_candidates_with_new_settings():
    app = replay_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("s")
        recorded = app.subject.trace
        await set_sampling(pilot, app, top_p="0.5")
        await pilot.click("#apply")
        await pilot.pause()
        trace = app.subject.trace
        expected = explain_candidates(
            recorded.candidates, SamplingParams(0.7, 50, 0.5, 0.0, 0), recorded.chosen_id,
            recorded_temperature=0.7, vocab_size=recorded.vocab_size,
        )
        assert kept_ids(trace) == kept_ids(expected)
        assert len(kept_ids(trace)) < len(kept_ids(recorded))
        assert "re-filtered" in app.subject.label
        assert "top-p 0.5" in panel_text(app, "#logits")


async def test_layout_adapts_to_the_terminal_size():
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()

        def on_screen() -> list[str]:
            screen = app.screen.region
            shown = [p for p in app.query(Panel) if p.display and p.region.area]
            assert all(screen.contains_region(p.region) for p in shown)
            return sorted(p.id for p in shown)

        assert not app.wide
        assert on_screen() == ["logits", "pipeline", "readout", "tokens"]
        await pilot.press("2")
        assert on_screen() == ["kv", "pipeline", "readout", "tokens"]
        await pilot.resize_terminal(160, 50)
        await pilot.pause()
        assert app.wide
        assert on_screen() == ["kv", "latency", "layouts", "logits", "pipeline", "readout", "tokens"]
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert on_screen() == ["kv", "pipeline", "readout", "tokens"]


async def test_export_writes_a_new_folder_each_time(tmp_path):
    app = replay_app(export_root=tmp_path)
    async with app.run_test() as pilot:
        await pilot.press("x")  # not finished yet: nothing written
        assert app.last_export is None
        await pilot.press("end", "x")
        first = app.last_export
        await pilot.press("x")
        second = app.last_export
    result_id = read_trace(TRACE)[1][-1].result.request_id
    assert first == tmp_path / result_id and second == tmp_path / f"{result_id}-2"
    for folder in (first, second):
        assert (folder / METRICS_JSON).is_file()
        _, events = read_trace(folder / TRACE_JSONL)
        assert events == read_trace(TRACE)[1]


async def test_help_and_palette_list_every_key():
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = panel_text(app, "HelpScreen Static")
        for key in keys_for("replay"):
            assert key.help in text
        await pilot.press("escape")
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        assert {k.label for k in keys_for("replay") if not k.action.startswith(("cursor", "view("))} <= set(commands)
        await commands["Step"].callback()  # the palette runs the same action as the key
        await commands["Show kv panel"].callback()
        assert len(app.view.tokens) == 1 and app.compact_view == "kv"


def test_replay_command_reports_a_missing_trace_in_one_line(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "none.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("reqscope: error: cannot read trace") and "\n" not in err


# -- end to end -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_real_model_end_to_end_then_replay_the_export(default_model_dir, tmp_path):
    argv = ["--model", str(default_model_dir), "--device", "cpu", "--temperature", "0", "--max-tokens", "6"]
    args = build_parser("run").parse_args(argv)
    model = ModelFolder.of(args)
    request = request_from_args(args, DEFAULT_PROMPT, model)
    app = LiveExplorer(lambda progress: open_engine(args, model, progress=progress), request, export_root=tmp_path)
    async with app.run_test(size=(160, 50)) as pilot:
        await finished(pilot, app)
        result = app.view.result
        assert result.finish_reason == "length" and result.error is None
        reference = next(e for e in app.engine.generate(request) if isinstance(e, DoneEvent)).result
        assert result.token_ids == reference.token_ids  # greedy: the UI changes nothing
        figures = latency_figures(app.view)
        assert figures.wall == result.metrics and figures.engine == result.engine_metrics == result.metrics
        assert figures.held_ms == result.held_ms == 0.0  # never paused: one clock
        assert figures.itl.mean == pytest.approx(result.metrics.tpot_ms)
        assert "TTFT" in panel_text(app, "#latency")
        await pilot.press("x")
        folder = app.last_export
    assert folder == tmp_path / result.request_id
    header, events = read_trace(folder / TRACE_JSONL)
    assert header.kv_heads == 3 and header.q_heads == 9
    replay = ReplayExplorer(header, events)
    async with replay.run_test() as pilot:
        await pilot.press("end")
        assert replay.view.result.token_ids == result.token_ids


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 4, b'{"type": "reqscope-trace"}\n', b"[1, 2]\n", b"not json\n", b"{}\n"],
    ids=["random-bytes", "header-without-fields", "not-an-object", "not-json", "no-header"],
)
def test_replay_of_a_file_that_is_no_trace_is_one_line_and_exit_2(tmp_path, capsys, content):
    from reqscope.cli import main

    path = tmp_path / "trace.jsonl"
    path.write_bytes(content)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("reqscope: error: ") and str(path) in err
