"""The explorer's logic without a screen: the event fold, latency, layout arithmetic, the run gate, forms."""

from __future__ import annotations

import threading

import pytest

from minengine.engine.events import DoneEvent, PrefillEvent, StageEvent, StepReady, TokenEvent
from minengine.errors import RequestError
from minengine.kv.usage import KVUsage
from minengine.record.trace_io import TraceHeader
from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import Candidate, StepTrace
from reqscope.ui.base import renewed
from reqscope.ui.endpoint.app import EndpointApp
from reqscope.ui.glyphs import PlotSeries, bar, columns, plot, sparkline
from reqscope.ui.keys import ENDPOINT, LIVE, REPLAY, action_name, keys_for
from reqscope.ui.run.export_folder import claim_run_folder
from reqscope.ui.run.figures.kv_growth import growth_points
from reqscope.ui.run.figures.latency import latency_figures
from reqscope.ui.run.figures.layout_compare import element_bytes, formula_rows
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.live import LiveRun
from reqscope.ui.run.live_app import LiveExplorer
from reqscope.ui.run.panels.kv import growth_chart
from reqscope.ui.run.panels.logits import basis_note, chain_text, cut_positions
from reqscope.ui.run.panels.readout import fit_line, readout_items
from reqscope.ui.run.replay import ReplayRun
from reqscope.ui.run.replay_app import ReplayExplorer
from reqscope.ui.run.sampling_form import parse_choice
from reqscope.ui.run.view import RunView

SMOLLM = TraceHeader("SmolLM2-135M-Instruct", "", layers=30, q_heads=9, kv_heads=3, head_dim=64,
                     dtype="float32", device="cpu", load_ms=0.0)


def kv_usage(tokens: int, heads: int = 3, elem: int = 4, layers: int = 30, head_dim: int = 64) -> KVUsage:
    per_token = 2 * layers * heads * head_dim * elem
    return KVUsage(
        layout="gqa", dtype="float32", tokens=tokens, block_size=16, blocks=-(-tokens // 16), layers=layers,
        stored_heads=heads, head_dim=head_dim, bytes_per_token=per_token, logical_bytes=per_token * tokens,
        physical_bytes=per_token * 16 * -(-tokens // 16), reserved_bytes=per_token * 64,
        per_layer_tokens=(tokens,) * layers, per_layer_logical_bytes=(per_token // layers * tokens,) * layers,
        per_layer_physical_bytes=(per_token // layers * 16 * -(-tokens // 16),) * layers,
    )


def token(index: int, t_ms: float, text: str = "x", held_ms: float = 0.0) -> TokenEvent:
    return TokenEvent(index=index, token_id=100 + index, piece=text, text=text, t_ms=t_ms, itl_ms=None,
                      step_ms=5.0, kv=kv_usage(10 + index), trace=None, held_ms=held_ms)


def frame_of(view: RunView, max_tokens: int = 256) -> Frame:
    return Frame(header=SMOLLM, view=view, request_id="req-1", max_tokens=max_tokens, params=SamplingParams(),
                 state="running", replay=False, latency=latency_figures(view))


def stage(name: str, start: float, end: float) -> StageEvent:
    return StageEvent(name, start, end)


# -- the fold ---------------------------------------------------------------------------------


def test_run_view_tracks_the_current_stage_and_running_durations():
    view = RunView()
    assert view.current_stage() == "gateway"
    for i, name in enumerate(("gateway", "template", "tokenize", "admit")):
        view.apply(stage(name, i, i + 1))
    assert view.current_stage() == "prefix_cache"
    view.apply(stage("prefix_cache", 4.0, 5.0))
    assert view.current_stage() == "prefill"
    view.apply(stage("prefill", 5.0, 40.0))
    view.apply(PrefillEvent(10, 35.0, kv_usage(10)))
    view.apply(StepReady(0))
    assert view.current_stage() == "decode" and view.waiting_step == 0
    view.apply(token(0, 50.0, ""))  # held back: not visible
    view.apply(token(1, 60.0))
    view.apply(token(2, 75.0))
    assert view.waiting_step is None
    assert view.stage_ms("decode") == 35.0  # prefill end (40) to the last token (75)
    assert view.stage_ms("stream") == 15.0  # first visible (60) to last visible (75)
    assert view.kv.tokens == 12 and view.text == "xx"


def test_latency_figures_follow_the_metric_definitions():
    view = RunView()
    view.apply(PrefillEvent(10, 80.0, kv_usage(10)))
    for i, t in enumerate((100.0, 130.0, 170.0, 220.0)):
        view.apply(token(i, t))
    fig = latency_figures(view)
    m = fig.engine
    assert (m.ttft_ms, m.e2e_ms) == (100.0, 220.0)
    assert m.tpot_ms == pytest.approx(40.0)  # (220 - 100) / (4 - 1)
    assert m.decode_output_tokens_per_second == pytest.approx(25.0)  # 3 gaps in 0.12 s
    assert m.whole_request_output_tokens_per_second == pytest.approx(4 / 0.22)
    assert fig.itls_ms == (30.0, 40.0, 50.0) and fig.last_itl_ms == 50.0
    assert (fig.itl.median, fig.itl.max) == (40.0, 50.0)
    assert fig.prefill_ms_per_token == 8.0
    assert fig.wall == fig.engine and fig.held_ms == 0.0  # nobody held it: one clock


def test_latency_figures_take_the_held_time_out():
    view = RunView()
    view.apply(PrefillEvent(10, 80.0, kv_usage(10)))
    # Token 2 came 2 s late: the run was paused at its step for 1,980 ms.
    for i, (t, held) in enumerate(((100.0, 0.0), (130.0, 0.0), (2150.0, 1980.0), (2190.0, 0.0))):
        view.apply(token(i, t, held_ms=held))
    fig = latency_figures(view)
    assert fig.held_ms == 1980.0
    assert fig.itls_ms == (30.0, 40.0, 40.0)  # engine clock: the pause is gone
    assert fig.wall_last_itl_ms == 40.0 and fig.last_itl_ms == 40.0
    assert fig.wall.itl.max == 2020.0 and fig.itl.max == 40.0
    assert fig.engine.tpot_ms == pytest.approx(110.0 / 3) and fig.wall.tpot_ms == pytest.approx(2090.0 / 3)
    assert fig.engine.ttft_ms == fig.wall.ttft_ms == 100.0


def test_the_readout_keeps_every_figure_down_to_80_columns():
    view = RunView()
    view.apply(PrefillEvent(10, 80.0, kv_usage(10)))
    for i, (t, held) in enumerate(((1234.5, 0.0), (1300.0, 0.0), (9400.0, 8000.0), (9480.0, 0.0))):
        view.apply(token(i, t, held_ms=held))
    items = readout_items(frame_of(view))
    wide = fit_line(items, 200).plain
    assert wide.startswith("out 4/256 tok · TTFT 1.23 s · ITL last 80.0 ms · p50 80.0 ms · decode ")
    assert "MiB logical/physical, gqa cache fp32" in wide and "held by you 8.0 s" in wide
    for width in (78, 100, 138):
        line = fit_line(items, width).plain
        assert len(line) <= width, line
        for needle in ("4", "TTFT 1.23", "ITL", "p50 80.0", "t", "KV 0.", "gqa", "held"):
            assert needle in line, (width, line)
    assert fit_line(items, 78).plain == "4 tok TTFT 1.23s ITL 80.0ms p50 80.0ms 12.2t/s KV 0.57/0.70 MiB gqa held 8.0s"
    nothing = readout_items(frame_of(RunView()))
    assert fit_line(nothing, 78).plain.startswith("out 0/256 tok · TTFT – · ITL last –")


def test_kv_growth_points_are_bounded_and_keep_both_ends():
    view = RunView()
    view.apply(PrefillEvent(10, 80.0, kv_usage(10)))
    for i in range(2000):
        view.apply(token(i, 100.0 + i))
    points = growth_points(view, limit=100)
    assert len(points) <= 101
    assert (points[0].tokens, points[-1].tokens) == (10, 2009)
    assert all(p.physical_bytes >= p.logical_bytes for p in points)


def test_the_growth_chart_draws_the_run_and_the_other_layouts():
    view = RunView()
    view.apply(PrefillEvent(10, 80.0, kv_usage(10)))
    for i in range(40):
        view.apply(token(i, 100.0 + i))
    wide = growth_chart(frame_of(view), view.kv, 100, 10)[0].plain
    # Scaled to this run: MHA's line leaves the top (↑), MQA's stays below.
    assert wide == "MiB by cached tokens: ━ gqa logical ━ physical, blocks of 16 ┄ MHA↑ ┄ MQA formula"
    lines = [line.plain for line in growth_chart(frame_of(view), view.kv, 60, 10)]
    assert len(lines) == 10 and all(len(line) <= 60 for line in lines)
    assert lines[0] == "MiB: ━ gqa logical ━ physical (16-token blocks) ┄ MHA↑ ┄ MQA"
    top = 46080 * 64 * 1.2 / 2**20  # this run's physical bytes (4 blocks of 16 for 49 tokens), plus headroom
    assert lines[1].startswith(f"{top:.3g}┤") and lines[-2].lstrip().startswith("0┤")
    assert lines[-1].endswith("49 tokens") and "↑10 prompt" in lines[-1]
    assert sum(ch != " " for line in lines[1:-1] for ch in line[6:]) > 60  # something is drawn


def test_plot_draws_lines_and_steps_in_braille():
    rising = plot([PlotSeries((0, 10), (0, 10), "")], 5, 2, 10, 10)
    assert [t.plain for t in rising] == ["  ⢀⡤⠞", "⣠⠖⠋  "]  # each column joined to the one before
    step = plot([PlotSeries((0, 5, 10), (0, 10, 10), "", step=True)], 5, 2, 10, 10)
    assert [t.plain for t in step] == ["  ⢸⠉⠉", "⣀⣀⣸  "]  # flat at 0, straight up at x = 5, flat at the top
    dotted = plot([PlotSeries((0, 10), (0, 10), "", dotted=True)], 5, 2, 10, 10)
    assert [t.plain for t in dotted] == ["   ⠄⠂", "⡀⠂⠁  "]  # every other column, unjoined
    assert plot([PlotSeries((), (), "")], 3, 1, 1, 1)[0].plain == "   "


# -- GQA vs MHA -------------------------------------------------------------------------------


def test_formula_rows_use_kv_heads_for_gqa_and_query_heads_for_mha():
    rows = formula_rows(SMOLLM, kv_usage(57))
    assert [(r.name, r.heads, r.bytes_per_token) for r in rows] == [
        ("GQA", 3, 46080), ("MHA", 9, 138240), ("MQA", 1, 15360)
    ]
    assert rows[1].bytes_now == 138240 * 57
    assert element_bytes(kv_usage(5, elem=2)) == 2


def test_an_mha_model_compares_with_mqa_only():
    header = TraceHeader("m", "", layers=2, q_heads=4, kv_heads=4, head_dim=8, dtype="float32", device="cpu",
                         load_ms=0.0)
    rows = formula_rows(header, kv_usage(3, heads=4, layers=2, head_dim=8))
    assert [(r.name, r.heads) for r in rows] == [("MHA", 4), ("MQA", 1)]


# -- the logits panel's arithmetic ---------------------------------------------------------------


def test_chain_text_follows_the_order():
    assert chain_text(SamplingParams(0.7, 50, 0.9, 0.0)) == (
        "logits -> temperature 0.7 -> top_k 50 -> top_p 0.9 -> min_p off -> dist"
    )
    llama = SamplingParams(0.8, 40, 0.95, 0.05, order=SamplingParams.parse_order("llama.cpp"))
    assert chain_text(llama) == "logits -> top_k 40 -> top_p 0.95 -> min_p 0.05 -> temperature 0.8 -> dist"
    assert chain_text(SamplingParams(temperature=0)).startswith("logits -> argmax")


def test_cut_lines_sit_above_the_first_token_each_stage_dropped():
    dropped = [None, None, "top_p", "top_p", "top_k", "top_k"]
    cands = tuple(
        Candidate(i, f"t{i}", 10.0 - i, 0.1, by, 0.5 + 0.1 * i, 0.5 if by is None else 0.0)
        for i, by in enumerate(dropped)
    )
    trace = StepTrace(params=SamplingParams(1.0, 4, 0.6, 0.0), candidates=cands,
                      chosen_id=0, chosen_piece="t0", chosen_logprob=-0.5, sample_logprob=-0.7, entropy=1.0,
                      kept=2, top_p_cut=0.6, forced=False)
    assert cut_positions(trace) == {4: "top-k 4", 2: "top-p 0.6, kept 0.600"}


@pytest.mark.parametrize("params", [
    SamplingParams(0.7, 50, 0.9, 0.0),  # the CLI's default: top-k renormalises before top-p
    SamplingParams(0.7, 0, 0.9, 0.0),  # top-p sees p(T) itself
    SamplingParams(0.8, 0, 0.95, 0.05, order=SamplingParams.parse_order("vllm")),  # min-p before top-p
    SamplingParams(0.8, 0, 0.95, 0.0, order=SamplingParams.parse_order("llama.cpp")),  # T after top-p
])
def test_the_basis_note_says_when_p_and_the_top_p_sum_are_on_other_distributions(params):
    import torch

    from minengine.sampling.trace import explain

    logits = torch.randn(300, generator=torch.Generator().manual_seed(3)) * 3
    trace = explain(logits, params, chosen_id=int(logits.argmax()), piece=str, top_n=30)
    prob_sums = [sum(c.prob for c in trace.candidates[: i + 1]) for i in range(len(trace.candidates))]
    agree = all(abs(s - c.cumulative) < 1e-5 for s, c in zip(prob_sums, trace.candidates, strict=True))
    note = basis_note(params, trace.vocab_size)
    assert (note is None) == agree
    if note is not None:
        assert note.startswith("p(T): all 300 tokens · Σtop-p: ")


# -- replay --------------------------------------------------------------------------------------


def test_replay_rests_at_each_step_and_steps_back_exactly():
    events = [stage("gateway", 0, 1), StepReady(0), token(0, 10.0), StepReady(1), token(1, 25.0),
              DoneEvent(result=None)]
    replay = ReplayRun(SMOLLM, events)
    assert replay.stops == [2, 4, 6] and replay.cursor == 2
    assert replay.pending_token() == events[2] and replay.view().tokens == []
    assert replay.forward() and replay.view().tokens == [events[2]]
    assert replay.next_delay_ms() == 15.0
    assert replay.forward() and replay.at_end and not replay.forward()
    assert replay.back() and replay.back() and replay.at_start and not replay.back()


# -- the worker's gate -------------------------------------------------------------------------


class _FakeSession:
    """Yields a StepReady/TokenEvent pair per token, like a RequestSession, and records controls."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.produced = 0
        self.holds = 0
        self.cancelled = threading.Event()

    def __iter__(self):
        for i in range(self.tokens):
            yield StepReady(i)
            if self.cancelled.is_set():
                break
            self.produced += 1
            yield token(i, float(i))
        yield DoneEvent(result=None)

    def cancel(self):
        self.cancelled.set()

    def hold(self):
        self.holds += 1


class _FakeEngine:
    def __init__(self, session):
        self.session = session

    def start(self, request):
        return self.session


def _wait(predicate, timeout: float = 5.0) -> None:
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        event.wait(0.01)
    raise AssertionError("condition not reached")


def test_the_gate_lets_exactly_one_token_through_per_step():
    session = _FakeSession(tokens=5)
    live = LiveRun(_FakeEngine(session), request=None, paused=True)
    worker = threading.Thread(target=live.drive)
    worker.start()
    _wait(lambda: live.held_at == 0)
    assert session.produced == 0
    live.step()
    _wait(lambda: live.held_at == 1)
    assert session.produced == 1
    live.resume()
    _wait(live.finished.is_set)
    assert session.produced == 5 and live.failure is None
    assert session.holds == 2  # the session was told each time a step was held: steps 0 and 1
    assert sum(isinstance(e, TokenEvent) for e in live.inbox) == 5


def test_cancel_releases_a_held_step():
    session = _FakeSession(tokens=5)
    live = LiveRun(_FakeEngine(session), request=None, paused=True)
    worker = threading.Thread(target=live.drive)
    worker.start()
    _wait(lambda: live.held_at == 0)
    live.cancel()
    worker.join(5)
    assert live.finished.is_set() and session.produced == 0
    with pytest.raises(RuntimeError):
        live.preview(SamplingParams())


# -- forms, folders, keys, glyphs --------------------------------------------------------------


FORM = {"temperature": "0.5", "top_k": "20", "top_p": "0.8", "min_p": "0.05", "seed": "", "max_tokens": "64",
        "order": "llama.cpp"}


def test_sampling_form_values_become_validated_params():
    choice = parse_choice(FORM, SamplingParams())
    assert choice.params == SamplingParams(0.5, 20, 0.8, 0.05, None, SamplingParams.parse_order("llama.cpp"))
    assert choice.max_tokens == 64


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_p", "1.5", "top_p must be in (0, 1]"),
        ("temperature", "warm", "temperature must be a number"),
        ("top_k", "2.5", "top_k must be an integer"),
        ("max_tokens", "0", "max tokens must be at least 1"),
        ("order", "top_k,top_p", "sampler order must be"),
    ],
)
def test_sampling_form_refuses_bad_values(field, value, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace("]", r"\]")):
        parse_choice(FORM | {field: value}, SamplingParams())


def test_run_folders_are_never_reused(tmp_path):
    first = claim_run_folder(tmp_path, "req-1")
    (first / "keep.txt").write_text("mine")
    assert claim_run_folder(tmp_path, "req-1") == tmp_path / "req-1-2"
    assert claim_run_folder(tmp_path, "req-1") == tmp_path / "req-1-3"
    assert (first / "keep.txt").read_text() == "mine"


def test_a_renewed_request_keeps_everything_but_its_id():
    from ui_fixtures import kyoto_request

    request = kyoto_request()
    again = renewed(request, kv_layout="mha")
    assert again.request_id != request.request_id
    assert (again.messages, again.sampling, again.kv_layout) == (request.messages, request.sampling, "mha")


@pytest.mark.parametrize(("mode", "app"), [(LIVE, LiveExplorer), (REPLAY, ReplayExplorer), (ENDPOINT, EndpointApp)])
def test_every_key_has_an_action_on_the_app(mode, app):
    for key in keys_for(mode):  # every key has a mode, so every key is checked on the app of each of its modes
        assert callable(getattr(app, f"action_{action_name(key)}", None)), key.action


def test_an_action_of_another_modes_keys_never_runs():
    from ui_fixtures import replay_app

    app = replay_app()  # it inherits restart and the prompt form from the base both explorers share
    assert app.check_action("step_back", ()) and app.check_action("quit", ())
    assert not any(app.check_action(action, ()) for action in ("restart", "edit_prompt", "pick", "cancel"))


def test_glyphs():
    assert bar(0.5, 4) == "██  "
    assert bar(1 / 16, 2) == "▏ "
    assert sparkline([1.0, 2.0, 3.0], 3) == "▁▅█"
    assert sparkline([5.0] * 10, 4) == "▄▄▄▄"
    assert columns([0.5, 1.0], 2) == [" █", "██"]


def test_the_closing_line_names_the_outcome():
    from minengine.engine.events import RequestResult, Usage
    from minengine.engine.metrics import request_metrics
    from reqscope.ui.outcome import outcome

    view = RunView()
    assert outcome(view) == "left while running (0 tokens generated)"
    metrics = request_metrics(0.0, 100.0, 220.0, 4, [100.0, 130.0, 170.0, 220.0])
    view.apply(DoneEvent(RequestResult("req-1", "length", "abcd", (1, 2, 3, 4), Usage(10, 4), (), (), metrics,
                                       0.0, None, ())))
    assert outcome(view) == "length: 4 tokens, TTFT 100.0 ms, TPOT 40.00 ms, decode 25.00 tok/s, E2E 220.0 ms"


def test_the_pacer_spaces_repaints_by_their_measured_cost():
    from reqscope.ui.repaint_pacer import RepaintPacer

    clock = {"wall": 0.0, "cpu": 0.0}
    pacer = RepaintPacer(max_hz=30, duty=0.1, slowest_s=2.0, wall=lambda: clock["wall"], cpu=lambda: clock["cpu"])
    assert pacer.wait_s() < 0  # nothing drawn yet: repaint at once
    pacer.repainting()
    assert pacer.interval_s == pytest.approx(1 / 30)  # no cost known yet: the rate cap
    clock["cpu"] += 0.02  # drawing took 20 ms of the UI thread
    clock["wall"] += 0.05
    pacer.repainting()
    assert pacer.interval_s == pytest.approx(0.2)  # 20 ms is 10% of 200 ms
    clock["wall"] += 0.15
    assert pacer.wait_s() == pytest.approx(0.05)
    clock["cpu"] += 1.0  # a very slow terminal: never wait more than slowest_s
    pacer.repainting()
    assert pacer.interval_s == 2.0
