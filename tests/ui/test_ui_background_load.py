"""The explorer under a server's load: `--background 32` on its own engine, at 80x24, with Pilot.

Thirty-two background requests share the explorer's engine with the request on screen, joining
it after its first steps alone, as `reqscope --background 32 PROMPT` runs them (the engine admits
by capacity: 64 sequences a step on a CPU, so all of them run at once). While they run, the
request's views stay live (its tokens come and a repaint shows a later step) and the batch panel
(key 6, where a small terminal starts under load) stays readable in its 76 columns: each line
fits whole, the step line included, so no figure is cut by the ellipsis; and the run finishes.
"""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len
from test_ui import panel_text
from ui_fixtures import background_threads, finished, kyoto_request, live_app, wait_for

from minengine.engine.engine import Engine
from reqscope.engine_load import LoadOptions
from reqscope.ui.run.live_app import LiveExplorer

pytestmark = pytest.mark.anyio

SIZE = (80, 24)
BACKGROUND = 32
MAX_TOKENS = 500  # the others have all joined by its 100th token or so: long enough to be seen running beside them
SHARED_BY = 16  # sequences the step on screen shows at least, once the others have joined it
# The step line in each of its wordings (`reqscope.ui.run.panels.batch.step_line`), whole: it ends
# with the queue's count and, where it fits, the step's path.
STEP_LINE = re.compile(
    r"step (?P<step>\d+)(?: \(token \d+\))?: (?P<sequences>\d+) seq(?:uences)?(?: \((?:\d+ others?|alone)\))?"
    r" · \d+(?: decode \+ |\+)\d+(?: prefill tok(?:ens)?| tok) · queue \d+(?: · \S+)?"
)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def own_engine(chatty_tiny_dir):
    """An engine of this test's own, its KV room for every background request at once."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)


def batch_lines(app: LiveExplorer) -> list[str]:
    """The batch panel's lines as drawn for its own size, trailing blanks left out."""
    return [line.rstrip() for line in panel_text(app, "#batch").splitlines() if line.strip()]


def shown_step(app: LiveExplorer) -> tuple[int, int] | None:
    """(step, sequences) of the step line on screen, None while the panel shows none whole."""
    for line in batch_lines(app):
        match = STEP_LINE.fullmatch(line)
        if match:
            return int(match["step"]), int(match["sequences"])
    return None


def assert_readable(app: LiveExplorer) -> None:
    """Every line of the batch panel fits its width, so the screen cuts none of them."""
    width = app.screen.query_one("#batch").content_size.width
    assert 0 < width < SIZE[0]
    lines = batch_lines(app)
    assert lines[0] == f"engine shared with {BACKGROUND} background requests", lines
    too_wide = [line for line in lines if cell_len(line) > width]
    assert not too_wide, (width, too_wide)
    assert not [line for line in lines if line.endswith("…")], lines
    assert shown_step(app) is not None, lines  # the step line, whole


async def test_the_explorer_under_32_background_requests_stays_live_and_readable_at_80x24(own_engine):
    assert own_engine.steps.limits.max_num_seqs > BACKGROUND  # admission by capacity: they all run at once
    app = live_app(own_engine, kyoto_request(max_tokens=MAX_TOKENS), load=LoadOptions(background=BACKGROUND))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("6")  # the batch panel (where a small terminal starts under load)
        # The others join after its first steps alone, and fill its steps as their prompts prefill.
        await wait_for(pilot, lambda: (shown_step(app) or (0, 0))[1] >= SHARED_BY or app.view.result is not None,
                       timeout=120)  # fmt: skip
        assert app.view.result is None, "the run ended before a step it shared with the others was shown"
        load = app.load
        assert load is not None and load.background.running
        assert app.compact_view == "batch" and app.screen.query_one("#batch").display
        assert f"+{BACKGROUND} background" in panel_text(app, "#status")
        assert_readable(app)
        assert re.search(r"^step time [\d.]+ ms · alone [\d.]+ ms → [\d.]+×", batch_lines(app)[2]), batch_lines(app)
        step, _ = shown_step(app) or (0, 0)
        tokens = len(app.view.tokens)
        # Views live: later tokens come, and the screen shows a later step, while the others still run.
        # A later step that still shares the engine with the others: one shown in between, as some
        # background requests end and others are admitted, may be thinner for a moment.
        def later_shared() -> bool:
            later, sequences = shown_step(app) or (0, 0)
            return (later > step and sequences >= SHARED_BY) or app.view.result is not None

        await wait_for(pilot, later_shared, timeout=120)
        assert app.view.result is None and load.background.running, "the run ended before the screen moved on"
        later, sequences = shown_step(app) or (0, 0)
        assert later > step and len(app.view.tokens) > tokens
        assert sequences >= SHARED_BY
        assert_readable(app)
        assert own_engine.scheduler.running > SHARED_BY  # the others still run beside it

        await finished(pilot, app, timeout=300)
        result = app.view.result
        assert result.finish_reason == "length" and len(app.view.tokens) == MAX_TOKENS
        assert_readable(app)
        assert f"whole run {result.batch.steps} steps, {result.batch.shared_steps} shared" in batch_lines(app)[-1]
        assert result.batch.max_batch > SHARED_BY
        await wait_for(pilot, lambda: not background_threads())  # they stop with the request on screen
        assert load.background.sent >= BACKGROUND and load.background.failed == 0, load.background.last_error
    assert not background_threads()
