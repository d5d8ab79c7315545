"""The explorer with tools, a grammar, penalties and bias, driven with Textual's Pilot on the real default model.

The request is built from the command line the README shows
(`reqscope --tools examples/search_hotels.json --tool-choice required "..."`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console
from textual.widgets import Input, Static
from ui_fixtures import finished, held_at, kyoto_request, live_app, wait_for

from minengine.errors import RequestError
from minengine.record.export import TRACE_JSONL
from minengine.record.trace_io import read_trace
from minengine.sampling.params import SamplingParams
from minengine.text.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from reqscope.cli import build_parser, main
from reqscope.run_options import DEFAULT_PROMPT, ModelFolder, request_from_args
from reqscope.ui.run.replay_app import ReplayExplorer
from reqscope.ui.run.sampling_form import SamplingForm, bias_text, parse_choice

pytestmark = pytest.mark.anyio
HOTELS = Path(__file__).resolve().parents[2] / "examples" / "search_hotels.json"
TOOLS_ARGV = ["--tools", str(HOTELS), "--tool-choice", "required", "--temperature", "0"]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def panel_text(app, selector: str) -> str:
    """What a widget on the current screen draws, as plain text."""
    widget = app.screen.query_one(selector)
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()


def tools_request(*extra: str):
    """The README's request, built by the command line's own parser."""
    args = build_parser("run").parse_args([*TOOLS_ARGV, *extra, DEFAULT_PROMPT])
    return request_from_args(args, DEFAULT_PROMPT, ModelFolder.of(args))


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_tools_block_and_the_grammar_are_on_screen(default_engine, size):
    app = live_app(default_engine, tools_request(), start_paused=True)
    async with app.run_test(size=size) as pilot:
        await held_at(pilot, app, 0)
        trace = app.subject.trace
        grammar = trace.adjustments.grammar
        assert grammar is not None and grammar.allowed == 1  # `<tool_call>` must open the reply
        logits = panel_text(app, "#logits")
        assert "logits -> grammar -> argmax" in logits
        assert f"grammar: 1 of {grammar.vocab_size:,} tokens allowed" in logits
        assert f"removed {grammar.mass_removed:.1%} of the mass" in logits
        assert grammar.removed[0].piece in logits.split("removed:")[1]  # the likeliest token it took away
        assert "× grammar" in logits  # the raw top candidates it forbade, marked in their rows

        await pilot.press("5")  # the template panel (in turn on a small screen)
        await wait_for(pilot, lambda: not app.needs_repaint)
        tools = {p.name: p.tokens for p in app.view.prompt.parts}["tools (reqscope)"]
        template = panel_text(app, "#template")
        assert f"{tools} tools (reqscope)" in template
        assert f"[tools: {tools} tokens, reqscope's own block: this template has no tool syntax]" in template
        readout = app.screen.query_one("#readout")
        assert app.screen.region.contains_region(readout.region)


async def test_a_token_the_grammar_forbids_is_refused_with_its_reason(default_engine):
    app = live_app(default_engine, tools_request(), start_paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await held_at(pilot, app, 0)
        candidates = app.subject.trace.candidates
        forbidden = next(i for i, c in enumerate(candidates) if c.dropped_by == "grammar")
        allowed = next(i for i, c in enumerate(candidates) if c.dropped_by is None)
        await pilot.press(*["down"] * forbidden)
        await pilot.press("enter")
        await pilot.pause(0.3)
        notes = [n.message for n in app._notifications]
        assert any("is not allowed by the" in n and "grammar here" in n for n in notes), notes
        assert app.view.tokens == [] and app.held_step == 0  # nothing committed: still held at step 1

        moves = ["down"] * (allowed - forbidden) if allowed > forbidden else ["up"] * (forbidden - allowed)
        await pilot.press(*moves)
        await pilot.press("enter")
        await held_at(pilot, app, 1)
        token = app.view.tokens[0]
        assert (token.token_id, token.forced) == (candidates[allowed].token_id, True)


async def test_bias_and_a_penalty_set_while_paused_move_a_token_to_the_top(default_engine):
    app = live_app(default_engine, kyoto_request(sampling=kyoto_request().sampling.with_(temperature=0)),
                   start_paused=True)  # fmt: skip
    async with app.run_test(size=(120, 40)) as pilot:
        await held_at(pilot, app, 0)
        fifth = app.subject.trace.candidates[4]
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, SamplingForm))
        form = app.screen
        form.query_one("#field-logit_bias", Input).value = f"{fifth.token_id}=20"
        form.query_one("#field-repetition_penalty", Input).value = "1.3"
        await pilot.pause()
        await pilot.click("#apply")
        await wait_for(pilot, lambda: app.screen is not form and not app.needs_repaint)
        trace = app.subject.trace
        assert trace.params.logit_bias == ((fifth.token_id, 20.0),) and trace.params.repetition_penalty == 1.3
        moved = next(c for c in trace.adjustments.changes if c.token_id == fifth.token_id)
        assert (moved.rank_before, moved.rank_after) == (5, 1)
        logits = panel_text(app, "#logits")
        assert "logits -> bias 1 token -> repetition 1.3 -> argmax" in logits
        assert "#5 -> #1" in logits and "winner changed:" in logits

        await pilot.press("s")
        await held_at(pilot, app, 1)
        assert app.view.tokens[0].token_id == fifth.token_id  # the bias made it the greedy choice


@pytest.fixture(scope="module")
def exported_tools_run(tmp_path_factory, default_model_dir):
    """The README's request run headless for 10 tokens and exported (`--plain --export DIR`)."""
    folder = tmp_path_factory.mktemp("tools-export")
    argv = ["--plain", "--model", str(default_model_dir), *TOOLS_ARGV, "--max-tokens", "10",
            "--export", str(folder), DEFAULT_PROMPT]  # fmt: skip
    assert main(argv) == 0
    return folder / TRACE_JSONL


async def test_a_replayed_tools_run_shows_its_grammar_and_tools_block(exported_tools_run):
    header, events = read_trace(exported_tools_run)
    app = ReplayExplorer(header, events, source_name=TRACE_JSONL)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("s", "s")
        await wait_for(pilot, lambda: not app.needs_repaint)
        logits = panel_text(app, "#logits")
        assert "logits -> grammar -> argmax" in logits and "tokens allowed" in logits
        assert app.subject.trace.adjustments.grammar is not None
        await pilot.press("5")
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert "[tools: " in panel_text(app, "#template")


async def set_in_form(pilot, app, **fields: str) -> None:
    """Open the sampling form (o), type `fields` and apply them."""
    await pilot.press("o")
    await wait_for(pilot, lambda: isinstance(app.screen, SamplingForm))
    form = app.screen
    for name, value in fields.items():
        form.query_one(f"#field-{name}", Input).value = value
    await pilot.pause()
    await pilot.click("#apply")
    await wait_for(pilot, lambda: app.screen is not form and not app.needs_repaint)


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_the_grammar_turns_off_and_on_at_the_held_step_then_the_call_completes(default_engine):
    app = live_app(default_engine, tools_request("--max-tokens", "120", "--no-parallel-tool-calls"), start_paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await held_at(pilot, app, 0)
        assert "grammar: 1 of" in panel_text(app, "#logits")

        await set_in_form(pilot, app, grammar="off")
        assert any(n.startswith("grammar off from step 1") for n in notes(app)), notes(app)
        assert app.subject.trace.adjustments is None  # the held step, the model's own row
        logits = panel_text(app, "#logits")
        assert "grammar" not in logits and "logits -> argmax" in logits

        await set_in_form(pilot, app, grammar="on")
        assert app.subject.trace.adjustments.grammar.allowed == 1  # `<tool_call>` must open the reply again
        assert "logits -> grammar -> argmax" in panel_text(app, "#logits")

        await pilot.press("space")
        await finished(pilot, app)
        result = app.view.result
        assert result.finish_reason == "stop", result.text
        body = result.text.strip().removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE)
        call = json.loads(body)
        assert call["name"] == "search_hotels"
        parameters = json.loads(HOTELS.read_text())[0]["function"]["parameters"]
        jsonschema.validate(call["arguments"], parameters)


async def test_the_grammar_on_again_after_a_free_token_is_refused_and_a_rerun_starts_off(default_engine):
    app = live_app(default_engine, tools_request("--max-tokens", "3"), start_paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await held_at(pilot, app, 0)
        await set_in_form(pilot, app, grammar="off")
        await pilot.press("s")  # the model's own first token, which the grammar forbids
        await held_at(pilot, app, 1)
        free = app.view.tokens[0]
        assert not free.forced and free.trace.adjustments is None

        await set_in_form(pilot, app, grammar="on")
        refusal = (f"the 1 token already generated do not fit the tool call (required) grammar at token 1 "
                   f"({free.piece!r}); the grammar stays off")  # fmt: skip
        assert refusal in notes(app), notes(app)
        assert app.sampling.grammar is False and app.subject.trace.adjustments is None
        assert "grammar" not in panel_text(app, "#logits")

        await pilot.press("r")  # the switch is kept: the next run starts with its grammar off
        await held_at(pilot, app, 0)
        assert app.request.tools == app.offered.tools and app.request.tool_choice.mode == "required"
        assert app.subject.trace.adjustments is None


async def test_the_tools_turn_off_and_on_for_the_next_run(default_engine):
    """Tools are written into the prompt: a running request keeps its own, the switch applies when it runs again (r)."""
    app = live_app(default_engine, tools_request("--max-tokens", "3"), start_paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await held_at(pilot, app, 0)
        await set_in_form(pilot, app, tools="off")
        assert any("tools off from the next run (r)" in n and "written into the prompt" in n for n in notes(app))
        assert app.subject.trace.adjustments.grammar is not None  # this run keeps its tools and their grammar

        await pilot.press("r")
        await held_at(pilot, app, 0)
        assert app.request.tools == () and app.request.structured is None
        assert "tools (reqscope)" not in {p.name for p in app.view.prompt.parts}
        assert app.subject.trace.adjustments is None
        assert "grammar" not in panel_text(app, "#logits")

        await set_in_form(pilot, app, grammar="off")
        assert any("no grammar to turn off or on" in n for n in notes(app)), notes(app)
        await set_in_form(pilot, app, tools="on", grammar="on")
        await pilot.press("r")
        await held_at(pilot, app, 0)
        assert app.request.tools == app.offered.tools and app.request.tool_choice.mode == "required"
        assert app.subject.trace.adjustments.grammar.allowed == 1


FORM = {"temperature": "0", "top_k": "0", "top_p": "1", "min_p": "0", "seed": "", "max_tokens": "16", "order": "hf"}


def test_the_form_reads_penalties_bias_and_the_tools_and_grammar_switches():
    fields = {"repetition_penalty": "1.2", "frequency_penalty": "-0.5", "presence_penalty": "2",
              "logit_bias": "13=5, 2=-100; 13=7", "tools": "off", "grammar": "off"}  # fmt: skip
    choice = parse_choice(FORM | fields, SamplingParams())
    p = choice.params
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.2, -0.5, 2.0)
    assert p.logit_bias == ((2, -100.0), (13, 7.0)) and bias_text(p.logit_bias) == "2=-100, 13=7"
    assert choice.tools is False and choice.grammar is False
    blank = parse_choice(FORM, SamplingParams())  # blank fields: every stage off, the tools and the grammar on
    assert not blank.params.adjusts_logits and blank.tools and blank.grammar


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("repetition_penalty", "0", "repetition_penalty must be in (0, 2]"),
        ("presence_penalty", "3", "presence_penalty must be between -2 and 2"),
        ("frequency_penalty", "lots", "frequency_penalty must be a number"),
        ("logit_bias", "5=101", "the bias must be between -100 and 100"),
        ("logit_bias", "five=1", "the token id must be a whole number"),
        ("tools", "maybe", "tools must be on or off"),
        ("grammar", "yes", "grammar must be on or off"),
    ],
)
def test_the_form_names_a_bad_penalty_bias_or_switch(field, value, message):
    with pytest.raises(RequestError) as info:
        parse_choice(FORM | {field: value}, SamplingParams())
    assert message in str(info.value)
