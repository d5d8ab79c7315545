"""`w`: the finished run on screen through another weight format, with a real engine on a tiny model.

The comparison's numbers are checked against an independent computation: each format's engine
decodes the run's tokens step by step through its bare runner (no session, no lock-step), and
KL and top-1 agreement are computed here from those logits.
"""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from ui_fixtures import finished, kyoto_request, live_app, wait_for

from minengine.engine.engine import Engine
from minengine.fast.linear_kernels import available
from minengine.sampling.params import SamplingParams
from reqscope.other_formats import other_formats, run_label

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def panel_text(app, selector: str) -> str:
    widget = app.screen.query_one(selector)
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.render())
    return console.export_text()


def forced_logits(engine: Engine, prompt: list[int], tokens: tuple[int, ...]) -> list[torch.Tensor]:
    """The next-token logits before each of `tokens`, decoding them one at a time through the bare runner."""
    runner = engine.runner
    cache = runner.new_cache(len(prompt) + len(tokens))
    try:
        out = [runner.forward(torch.tensor(prompt), 0, cache).float().reshape(-1)]
        for i, token in enumerate(tokens[:-1]):
            out.append(runner.forward(torch.tensor([token]), len(prompt) + i, cache).float().reshape(-1))
    finally:
        cache.release()
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.softmax(p_logits.double(), -1), torch.softmax(q_logits.double(), -1)
    return float((p * (p.log() - q.log())).sum())


def prompt_ids(engine: Engine, request) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render(list(request.messages)))


async def compared(pilot, app, fmt: str):
    await pilot.press("w")
    await wait_for(pilot, lambda: any(c.other.format == fmt and c.finished for c in app.formats.shown().comparisons)
                   and not app.formats.busy, timeout=120)  # fmt: skip
    return next(c for c in app.formats.shown().comparisons if c.other.format == fmt)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_w_compares_the_next_formats_against_an_independent_computation(chatty_engine, chatty_tiny_dir, size):
    request = kyoto_request(max_tokens=6, sampling=SamplingParams(temperature=0))
    app = live_app(chatty_engine, request)
    runnable = [f for f in ("fp16", "bf16", "int8") if available(f).ok]
    async with app.run_test(size=size) as pilot:
        await finished(pilot, app)
        tokens = app.view.result.token_ids
        assert "formats" not in app._detail_views()  # the panel joins once w has compared
        baseline = forced_logits(chatty_engine, prompt_ids(chatty_engine, request), tokens)
        for fmt in runnable:
            c = await compared(pilot, app, fmt)
            assert c.request_id == request.request_id and c.planned_steps == len(tokens) == len(c.steps)
            other_engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights=fmt,
                                  kv_budget_bytes=64 << 20)  # fmt: skip
            other = forced_logits(other_engine, prompt_ids(other_engine, request), tokens)
            for step, a, b in zip(c.steps, baseline, other, strict=True):
                assert step.baseline_top1 == int(a.argmax()) and step.other_top1 == int(b.argmax())
                assert step.kl == pytest.approx(kl(a, b), rel=1e-4, abs=1e-10)  # both in float64
            pairs = enumerate(zip(baseline, other, strict=True))
            parting = next((i for i, (a, b) in pairs if a.argmax() != b.argmax()), None)
            assert c.first_parting == parting
            assert c.baseline.format == "float32" and c.other.format == fmt
            assert c.baseline.tokens == c.other.tokens == len(tokens)
            assert c.other.weight_bytes_per_step == other_engine.model.decode_weight_bytes
            assert c.baseline.weight_bytes_per_step == chatty_engine.model.decode_weight_bytes
            assert c.other.ttft_ms is not None and c.other.decode_tokens_per_s is not None
            assert c.cost is not None and c.cost.load_ms > 0  # loaded on demand, a new format each press
            assert app.compact_view == "formats" and "formats" in app._detail_views()
            if size == (80, 24):  # the hint numbers it by its key, not its place among the panels
                assert "9 formats" in app.query_one("#formats").border_subtitle
            await wait_for(pilot, lambda: not app.needs_repaint)
            text = panel_text(app, "#formats")
            assert f"{fmt} " in text and f"{c.agreeing}/{len(tokens)}" in text and "float32" in text
        assert app.view.result.token_ids == tokens  # the run on screen is left as it was
        text = panel_text(app, "#formats")
        if "bf16" not in runnable:
            assert "bf16: not on this machine" in text


async def test_w_waits_for_the_run_to_finish_and_keeps_one_other_engine(chatty_engine):
    request = kyoto_request(max_tokens=3, sampling=SamplingParams(temperature=0))
    app = live_app(chatty_engine, request, start_paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.held_step == 0)
        await pilot.press("w")
        assert app.formats.shown() is None  # refused: nothing to compare yet
        await pilot.press("space")
        await finished(pilot, app)
        first = await compared(pilot, app, "fp16")
        kept = app.formats._other.engine
        assert kept is not None and kept.weights.format == "fp16" and first.cost is not None
        await pilot.press("w")  # the next one (another format, or the reference kernels) replaces it
        await wait_for(pilot, lambda: not app.formats.busy and app.formats._other.engine is not kept)
        assert run_label(app.formats._other.engine) != "fp16"  # one other engine at a time


async def test_from_150x40_the_formats_panel_is_a_strip_under_the_others(chatty_engine):
    app = live_app(chatty_engine, kyoto_request(max_tokens=3, sampling=SamplingParams(temperature=0)))
    async with app.run_test(size=(160, 50)) as pilot:
        await finished(pilot, app)
        latency = app.query_one("#latency").region
        await compared(pilot, app, "fp16")
        await wait_for(pilot, lambda: not app.needs_repaint)
        strip, tokens = app.query_one("#formats").region, app.query_one("#tokens").region
        assert app.wide and strip.height == 12 and strip.width == app.query_one("#body").region.width
        assert strip.y > tokens.y + tokens.height - 1 and app.query_one("#latency").region.height < latency.height
        assert "fp16 " in panel_text(app, "#formats")


async def test_w_sets_the_reference_kernels_beside_the_fast_path(chatty_engine, chatty_tiny_dir):
    """The last row `w` reaches is the reference model: its steps' KL against the fast path's is the
    KL of the two runners' logits computed here, and its top-1 tokens are the fast path's."""
    request = kyoto_request(max_tokens=5, sampling=SamplingParams(temperature=0))
    app = live_app(chatty_engine, request)
    order = [o.format for o in other_formats(chatty_engine, reference=True) if o.runs]
    assert order[-1] == "reference"
    async with app.run_test(size=(120, 40)) as pilot:
        await finished(pilot, app)
        tokens = app.view.result.token_ids
        for fmt in order:
            c = await compared(pilot, app, fmt)
        reference = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kernels="reference",
                           kv_budget_bytes=64 << 20)  # fmt: skip
        baseline = forced_logits(chatty_engine, prompt_ids(chatty_engine, request), tokens)
        other = forced_logits(reference, prompt_ids(reference, request), tokens)
        assert c.other.format == "reference" and c.baseline.format == "float32"
        for step, a, b in zip(c.steps, baseline, other, strict=True):
            assert step.kl == pytest.approx(kl(a, b), rel=1e-3, abs=1e-9)
            assert step.kl < 1e-6  # float32 both ways: the fast paths change the order of sums, not the maths
        assert c.first_parting is None and c.other.decode_tokens_per_s is not None
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert "reference " in panel_text(app, "#formats")
