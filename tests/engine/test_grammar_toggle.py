"""A steered request's grammar turned off and on again at a held step (`RequestSession.set_grammar`).

On the chatty tiny model (random weights, the default model's real tokenizer): off, its steps are
the model's own (a token the grammar forbade can be forced, the greedy pick is the free request's);
on again after tokens that fit, it goes on constrained and the reply validates (`jsonschema`); on
after tokens that do not fit, it is refused in one line naming the first misfit and stays off.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_grammar import HOTEL, request, schema_output

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, StepReady, TokenEvent
from minengine.errors import RequestError
from minengine.sampling.grammar import compile_grammar


@pytest.fixture(scope="module")
def engine(chatty_tiny_dir) -> Engine:
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)


def ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_off_at_a_held_step_frees_that_step_and_the_next(engine):
    free = engine.start(request(max_tokens=3, trace=True))
    free_tokens = [e.token_id for e in free if isinstance(e, TokenEvent)]
    hello = ids(engine, "Hello")[0]
    session = engine.start(request(structured=schema_output(), max_tokens=3, trace=True))
    tokens: list[TokenEvent] = []
    for event in session:
        if isinstance(event, StepReady) and event.index == 0:
            assert session.grammar_active and session.preview().adjustments.grammar is not None
            with pytest.raises(RequestError):
                session.force_next(hello)  # `{` must open the reply
            session.set_grammar(False)
            assert not session.grammar_active
            assert session.preview().adjustments is None  # the held step's row is the model's own again
        if isinstance(event, StepReady) and event.index == 1:
            session.force_next(hello)  # forbidden by the grammar, free now
        if isinstance(event, TokenEvent):
            tokens.append(event)
    assert tokens[0].trace.adjustments is None
    assert tokens[0].token_id == free_tokens[0]  # the greedy pick of the request without a schema
    assert tokens[1].token_id == hello and tokens[1].forced
    assert tokens[2].trace.adjustments is None


def test_on_again_after_tokens_that_fit_continues_constrained_and_validates(engine):
    opening = ids(engine, '{"name": "')
    session = engine.start(request(structured=schema_output(), max_tokens=120, trace=True))
    tokens: list[TokenEvent] = []
    for event in session:
        if isinstance(event, StepReady):
            if event.index == 0:
                session.set_grammar(False)
            if event.index < len(opening):
                session.force_next(opening[event.index])
            if event.index == len(opening):
                assert session.preview().adjustments is None
                session.set_grammar(True)
                grammar = session.preview().adjustments.grammar  # the held step masked before it is drawn
                assert session.grammar_active and grammar is not None and grammar.allowed < grammar.vocab_size
        if isinstance(event, TokenEvent):
            tokens.append(event)
    result = session.result
    assert result.finish_reason == "stop", result.text
    assert result.text.startswith('{"name": "')
    jsonschema.validate(json.loads(result.text), HOTEL)
    assert all(t.trace.adjustments is None for t in tokens[: len(opening)])
    assert all(t.trace.adjustments.grammar is not None for t in tokens[len(opening) :])


def test_on_after_tokens_that_do_not_fit_is_refused_and_stays_off(engine):
    hello = ids(engine, "Hello")[0]
    opening = ids(engine, '{"')[0]
    session = engine.start(request(structured=schema_output(), max_tokens=6, trace=True))
    for event in session:
        if isinstance(event, StepReady) and event.index == 0:
            session.set_grammar(False)
            session.force_next(opening)
        if isinstance(event, StepReady) and event.index == 1:
            session.force_next(hello)
        if isinstance(event, StepReady) and event.index == 2:
            with pytest.raises(RequestError) as caught:
                session.set_grammar(True)
            message = str(caught.value)
            assert message == (
                "the 2 tokens already generated do not fit the json_schema \"hotel\" grammar at token 2 ('Hello'); "
                "the grammar stays off"
            )
            assert not session.grammar_active and session.preview().adjustments is None
    result = session.result
    assert result.finish_reason == "length" and result.token_ids[:2] == (opening, hello)


def test_a_pick_waiting_for_the_step_must_fit_the_grammar_turned_on(engine):
    hello = ids(engine, "Hello")[0]
    session = engine.start(request(structured=schema_output(), max_tokens=1))
    for event in session:
        if isinstance(event, StepReady):
            session.set_grammar(False)
            session.force_next(hello)
            with pytest.raises(RequestError, match=r"token picked for the next step, \d+ \('Hello'\), is not allowed"):
                session.set_grammar(True)
            assert not session.grammar_active
    assert session.result.token_ids == (hello,)


def test_off_before_decode_starts_the_request_free(engine):
    free = [e for e in engine.start(request(max_tokens=4)) if isinstance(e, DoneEvent)][0].result
    session = engine.start(request(structured=schema_output(), max_tokens=4))
    session.set_grammar(False)  # before the first event: the grammar is compiled, its matcher never made
    list(session)
    assert session.result.token_ids == free.token_ids
    assert compile_grammar(session.request, engine.tokenizer) is not None  # the request keeps its schema


def test_a_request_without_a_grammar_refuses_the_switch_and_an_unsteered_one_too(engine):
    session = engine.start(request(max_tokens=1))
    with pytest.raises(RequestError, match="has no grammar to turn off or on"):
        session.set_grammar(False)
    unsteered = engine.start(request(structured=schema_output(), max_tokens=1), steered=False)
    with pytest.raises(RequestError, match="runs unsteered"):
        unsteered.set_grammar(False)
    list(session), list(unsteered)
