"""The explorer over `--kernels reference`: every view runs on the plain model, and says so.

The engine's fast paths and the reference model are two arithmetics for one function, so the
same greedy request gives the same tokens either way; on screen, the header names the reference
kernels, the logits panel names each step's path, and the inside views (attention, the logit
lens, a held step's full view) are computed by the reference model's forward.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from ui_fixtures import finished, held_at, kyoto_request, live_app, wait_for

from minengine.engine.engine import Engine
from minengine.sampling.params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def reference_engine(chatty_tiny_dir):
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kernels="reference", kv_budget_bytes=64 << 20)


def panel_text(app, selector: str) -> str:
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(app.screen.query_one(selector).render())
    return console.export_text()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_the_explorer_runs_on_the_reference_and_names_it(reference_engine, chatty_engine, size):
    request = kyoto_request(max_tokens=5, sampling=SamplingParams(temperature=0))
    fast = live_app(chatty_engine, request)
    async with fast.run_test(size=size) as pilot:
        await finished(pilot, fast)
        fast_tokens = fast.view.result.token_ids
        assert "reference kernels" not in panel_text(fast, "#status")
        assert "torch eager" in panel_text(fast, "#logits") or "c-stack" in panel_text(fast, "#logits")
    app = live_app(reference_engine, request, start_paused=True)
    async with app.run_test(size=size) as pilot:
        await held_at(pilot, app, 0)
        assert "reference kernels" in panel_text(app, "#status")
        await pilot.press("8")  # the lens of the held step: recomputed by the reference model
        await wait_for(pilot, lambda: app.shown.inspection() is not None)
        assert app.shown.inspection().inspection.lens is not None
        await pilot.press("7")
        await wait_for(pilot, lambda: (s := app.shown.inspection()) is not None and s.inspection.attention is not None)
        await pilot.press("1", "space")
        await finished(pilot, app)
        assert app.view.result.token_ids == fast_tokens
        assert {t.path for t in app.view.tokens} == {"reference"}
        assert "· reference" in panel_text(app, "#logits")
