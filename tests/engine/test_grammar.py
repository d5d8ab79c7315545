"""Structured output and forced tool calls, enforced by llguidance's grammar in the sampler.

The chatty tiny model (random weights, the default model's real tokenizer) writes nothing a person
would, which makes it a hard test: whatever it prefers, the grammar must leave only text that
parses and validates (`jsonschema`), matches the regex, or is one of the choices. The real default
model (marker `slow`) then checks the same on real text, sampled as well as greedy, beside other
requests in shared steps, and on the reference kernels.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from concurrent_runs import run_all

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, RequestResult, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.errors import RequestError
from minengine.sampling import grammar
from minengine.sampling.params import SamplingParams
from minengine.sampling.structured import StructuredOutput
from minengine.text.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, ToolChoice

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
PROMPT = "Show me wheelchair-accessible hotels in Kyoto as JSON."
# Nested objects, an array and an enum; strings and arrays bounded, so that even a model that
# never closes a string of its own accord ends within max_tokens.
HOTEL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["hotel", "ryokan", "hostel"]},
        "accessible": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Kyoto", "Osaka"]}, "ward": {"type": "string", "maxLength": 10}},
            "required": ["city", "ward"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "accessible", "tags", "address"],
    "additionalProperties": False,
}
SEARCH = Tool(
    "search_hotels",
    "Search hotels in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "wheelchair": {"type": "boolean"}},
            "required": ["city", "wheelchair"],
            "additionalProperties": False,
        }
    ),
)
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"enum": ["Kyoto", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)
CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\n(.*?)\n" + re.escape(TOOL_CALL_CLOSE), re.S)


def schema_output(schema: dict = HOTEL) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema), name="hotel")


def request(prompt: str = PROMPT, **kwargs) -> GenerationRequest:
    kwargs.setdefault("sampling", GREEDY)
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("trace", False)
    return GenerationRequest.from_prompt(prompt, **kwargs)


def run(engine: Engine, req: GenerationRequest, steered: bool = True) -> RequestResult:
    events = list(engine.start(req, steered=steered))
    assert isinstance(events[-1], DoneEvent)
    return events[-1].result


def calls_in(text: str) -> list[dict]:
    """The tool calls of a reply that must be nothing but calls, each parsed."""
    calls = CALL.findall(text)
    assert calls and CALL.sub("", text).strip() == "", text
    return [json.loads(body) for body in calls]


def validates(text: str, schema: dict = HOTEL) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def engine(chatty_tiny_dir) -> Engine:
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)


# -- what the request asks for, and its errors --------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"structured": StructuredOutput("regex", "a(")}, "structured_outputs.regex does not compile"),
        ({"structured": StructuredOutput("json_schema", '{"type": "frob"}')}, "response_format.json_schema.schema"),
        ({"structured": StructuredOutput("json_schema", '{"type": ')}, "response_format.json_schema.schema is not"),
        ({"structured": StructuredOutput("json_schema", "[1]")}, "response_format.json_schema.schema must be"),
        ({"structured": StructuredOutput("grammar", "start: undefined_rule")}, "structured_outputs.grammar does not"),
        ({"structured": StructuredOutput("choice")}, "structured_outputs.choice is empty"),
        (
            {"tools": (SEARCH, Tool("broken", parameters="[]")), "tool_choice": ToolChoice("required")},
            "tools[1].function.parameters must be a JSON object",
        ),
        (
            {"tools": (Tool("odd", parameters='{"type": "frob"}'),), "tool_choice": ToolChoice("required")},
            "tools[0].function.parameters does not compile",
        ),
        ({"tools": (SEARCH,), "tool_choice": ToolChoice("function", "nope")}, "tool_choice names function 'nope'"),
    ],
)
def test_a_grammar_that_cannot_compile_is_a_one_line_request_error(engine, changes, field):
    req = request(**changes)
    with pytest.raises(RequestError) as caught:
        grammar.check(req, engine.tokenizer)
    message = str(caught.value)
    assert message.startswith(field) and "\n" not in message
    result = run(engine, req)  # the session refuses it at its gateway, before it is queued
    assert result.finish_reason == "error" and result.error.startswith(field.split(" ")[0])
    assert result.usage.prompt_tokens == 0


def test_only_forced_tool_choices_and_structured_requests_have_a_grammar(engine):
    tok = engine.tokenizer
    assert grammar.compile_grammar(request(), tok) is None
    for mode in ("auto", "none"):
        assert grammar.compile_grammar(request(tools=(SEARCH,), tool_choice=ToolChoice(mode)), tok) is None
    assert grammar.compile_grammar(request(tools=(SEARCH,), tool_choice=ToolChoice("required")), tok) is not None


def test_logit_bias_ids_are_checked_against_the_vocabulary(engine):
    vocab = engine.cfg.vocab_size
    req = request(sampling=GREEDY.with_(logit_bias=((vocab, 1.0),)))
    result = run(engine, req)
    assert result.finish_reason == "error"
    assert result.error.startswith(f"logit_bias key {vocab} is outside the vocabulary (0..{vocab - 1})")


# -- what the grammar leaves, on a model that knows nothing ---------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_schema_constrained_reply_validates_even_from_a_random_model(engine, sampling):
    result = run(engine, request(structured=schema_output(), sampling=sampling, max_tokens=120))
    assert result.finish_reason == "stop", result.text
    validates(result.text)
    assert ", " in result.text and '": ' in result.text  # the compact but readable separators


def test_json_object_regex_choice_and_gbnf_replies_keep_their_shape(engine):
    obj = run(engine, request(structured=StructuredOutput("json_object"), max_tokens=40, sampling=SAMPLED))
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut off: still the start of one object
        assert obj.finish_reason == "length" and obj.text.startswith("{")
    pattern = r"[A-Z][a-z]{2,6}-\d{3}"
    regex = run(engine, request(structured=StructuredOutput("regex", pattern)))
    assert regex.finish_reason == "stop" and re.fullmatch(pattern, regex.text), regex.text
    choices = ("yes", "no", "only on weekdays")
    choice = run(engine, request(structured=StructuredOutput("choice", choices=choices), sampling=SAMPLED))
    assert choice.finish_reason == "stop" and choice.text in choices
    gbnf = 'root ::= "room " [0-9] [0-9]'  # llama.cpp's GBNF, converted to Lark
    room = run(engine, request(structured=StructuredOutput("grammar", gbnf)))
    assert re.fullmatch(r"room \d\d", room.text), room.text


@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_tool_choice_gives_calls_whose_arguments_validate(engine, parallel):
    tools = (SEARCH, WEATHER)
    req = request(tools=tools, tool_choice=ToolChoice("required"), parallel_tool_calls=parallel, max_tokens=100)
    result = run(engine, req)
    text = result.text
    if result.finish_reason == "length":  # parallel calls may go on: the complete ones are checked
        text = text[: text.rindex(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE)]
    calls = calls_in(text)
    if not parallel:
        assert len(calls) == 1 and result.finish_reason == "stop"
    schemas = {t.name: json.loads(t.parameters) for t in tools}
    for call in calls:
        assert list(call) == ["name", "arguments"]
        jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_a_named_tool_choice_calls_that_function(engine):
    req = request(tools=(SEARCH, WEATHER), tool_choice=ToolChoice("function", "get_weather"))
    result = run(engine, req)
    assert result.finish_reason == "stop"
    (call,) = calls_in(result.text)
    assert call["name"] == "get_weather" and call["arguments"]["city"] in ("Kyoto", "Tokyo")


def test_a_tools_definitions_still_resolve_inside_the_call(engine):
    room = {"type": "object", "properties": {"beds": {"enum": [1, 2]}}, "required": ["beds"]}
    parameters = {
        "type": "object",
        "properties": {"room": {"$ref": "#/$defs/room"}},
        "required": ["room"],
        "additionalProperties": False,
        "$defs": {"room": room},
    }
    book = Tool("book_room", parameters=json.dumps(parameters))
    result = run(engine, request(tools=(book,), tool_choice=ToolChoice("function", "book_room")))
    (call,) = calls_in(result.text)
    jsonschema.validate(call["arguments"], parameters)
    assert call["arguments"]["room"]["beds"] in (1, 2)


def test_max_tokens_inside_the_structure_ends_with_length(engine):
    result = run(engine, request(structured=schema_output(), max_tokens=6))
    assert result.finish_reason == "length" and len(result.token_ids) == 6 and result.text.startswith('{"name": "')


# -- the trace and the explorer's controls ---------------------------------------------------------


def test_the_trace_says_what_the_grammar_took_away(engine):
    req = request(structured=StructuredOutput("choice", choices=("yes", "no")), trace=True, top_n=5)
    tokens = [e for e in engine.start(req) if isinstance(e, TokenEvent)]
    first = tokens[0].trace.adjustments.grammar
    assert 0 < first.allowed < first.vocab_size == engine.cfg.vocab_size
    assert 0 < first.mass_removed <= 1 and first.removed
    assert all(r.prob > 0 for r in first.removed) and [r.prob for r in first.removed] == sorted(
        (r.prob for r in first.removed), reverse=True
    )
    assert tokens[0].trace.candidates[0].token_id == tokens[0].token_id  # the filters saw the masked row
    last = tokens[-1].trace.adjustments.grammar
    assert last.allowed == 1 and last.state == "done: only end of turn"
    assert tokens[-1].token_id in engine.tokenizer.eos_ids


def test_forcing_a_token_the_grammar_forbids_is_refused_with_the_reason(engine):
    req = request(structured=schema_output(), max_tokens=4)
    session = engine.start(req)
    forbidden = engine.tokenizer.encode("Hello")[0]
    opening = engine.tokenizer.encode('{"')[0]
    for event in session:
        if isinstance(event, StepReady) and event.index == 0:
            with pytest.raises(RequestError) as caught:
                session.force_next(forbidden)
            message = str(caught.value)
            assert "not allowed by the json_schema \"hotel\" grammar" in message and "forces" in message
            assert "\n" not in message
            preview = session.preview()
            assert preview.adjustments is not None and preview.adjustments.grammar.allowed >= 1
            session.force_next(opening)  # one it allows is taken
    assert session.result.token_ids[0] == opening and session.result.text.startswith('{"name": "')


# -- the mask, however it is computed and applied ---------------------------------------------------


def reference_mask(matcher: grammar.GrammarMatcher, row: torch.Tensor) -> torch.Tensor:
    """The mask applied as it first was: every token `allowed` does not name to -inf, in one masked_fill."""
    allowed = matcher.allowed()
    out = row.clone()
    out[: allowed.numel()].masked_fill_(~allowed, float("-inf"))
    out[allowed.numel() :] = float("-inf")
    return out


def walk(engine: Engine, structured: StructuredOutput) -> tuple[grammar.Grammar, list[int]]:
    """A constrained request's grammar, and the tokens the tiny model wrote under it."""
    req = request(structured=structured, max_tokens=60)
    return grammar.compile_grammar(req, engine.tokenizer), list(run(engine, req).token_ids)


def test_the_masked_row_forbids_exactly_what_the_grammar_forbids_at_every_step(engine):
    # A row a little longer than the vocabulary (a padded head): the entries past it are never allowed.
    # The schema's strings allow most of the vocabulary (the one-pass select), its keys and enums a
    # token or a few (the sparse copy); both are held against one masked_fill of the allowed tokens.
    compiled, tokens = walk(engine, schema_output())
    matcher = grammar.GrammarMatcher(compiled, engine.tokenizer, overlap=False)
    generator = torch.Generator().manual_seed(0)
    vocab = matcher.tokenizer.vocab_size
    sparse = dense = 0
    for token in tokens:
        row = torch.randn(vocab + 13, generator=generator)
        masked = matcher.masked(row)
        assert torch.equal(masked, reference_mask(matcher, row))
        assert masked.data_ptr() != row.data_ptr() and torch.isfinite(row).all()  # a copy: the logits stay
        allowed = int(matcher.allowed().sum())
        sparse, dense = sparse + (allowed <= 64), dense + (allowed > 4096)
        assert matcher.allows(token)
        matcher.accept(token)
    assert sparse > 5 and dense > 2


def test_after_a_forbidden_token_only_the_end_of_turn_is_left(engine):
    compiled, tokens = walk(engine, schema_output())
    matcher = grammar.GrammarMatcher(compiled, engine.tokenizer, overlap=False)
    forbidden = next(t for t in range(matcher.tokenizer.vocab_size) if not matcher.allows(t))
    matcher.accept(forbidden)
    row = torch.randn(matcher.tokenizer.vocab_size)
    finite = torch.isfinite(matcher.masked(row)).nonzero().flatten().tolist()
    assert finite == sorted(engine.tokenizer.eos_ids) and matcher.done


def test_masks_filled_in_the_step_are_the_workers_masks(engine):
    # A step loop turns each row's worker off and fills every row's mask at once, on its own thread,
    # before choosing: the same masks as the worker computes beside the forward.
    walks = [walk(engine, schema_output()), walk(engine, StructuredOutput("regex", r"[A-Z][a-z]{2,6}-\d{3}"))]
    workers = [grammar.GrammarMatcher(g, engine.tokenizer) for g, _ in walks]
    in_step = [grammar.GrammarMatcher(g, engine.tokenizer) for g, _ in walks]
    for matcher in in_step:
        matcher.fill_in_step()
    for step in range(max(len(tokens) for _, tokens in walks)):
        live = [i for i, (_, tokens) in enumerate(walks) if step < len(tokens)]
        for i in live:
            in_step[i].fill()
        for i in live:
            assert torch.equal(in_step[i].allowed(), workers[i].allowed())
            token = walks[i][1][step]
            for matcher in (workers[i], in_step[i]):
                matcher.accept(token)
            assert in_step[i]._pending is None  # no worker: the step fills it


# -- the same text wherever it runs ---------------------------------------------------------------


def test_a_constrained_request_beside_others_gets_its_tokens_alone(engine):
    constrained = request(structured=schema_output(), max_tokens=60)
    alone = run(engine, constrained, steered=False)
    others = [
        request("Tell me about Osaka", max_tokens=30),
        request("Name a ryokan", structured=StructuredOutput("regex", r"[a-z]{3,9}")),
        request("Hi", max_tokens=20, sampling=SAMPLED),
    ]
    together = run_all(engine, [constrained, *others], steered=False)
    results = [events[-1].result for events in together]
    assert results[0].token_ids == alone.token_ids and results[0].text == alone.text
    assert any(isinstance(e, TokenEvent) and e.batch is not None and e.batch.sequences > 1 for e in together[0])
    assert run(engine, constrained, steered=True).token_ids == alone.token_ids  # the session picks the same


def test_preempted_requests_with_penalties_and_grammars_count_each_token_once(chatty_tiny_dir, engine):
    # Preempted, a request recomputes its positions; its stages must not see its tokens twice (the
    # penalties would grow, the grammar would refuse), so it ends as it does alone.
    penalised = GREEDY.with_(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)
    reqs = [
        request("Tell me about Kyoto", sampling=penalised, max_tokens=48, ignore_eos=True),
        request("Name three hotels", sampling=penalised.with_(logit_bias=((11, 3.0),)), max_tokens=48, ignore_eos=True),
        request(structured=schema_output(), sampling=penalised, max_tokens=48),
        request("Hi", structured=schema_output(), max_tokens=48),
    ]
    alone = [run(engine, r) for r in reqs]
    worst = max(r.kv_peak.physical_bytes for r in alone)
    tight = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=int(worst * 1.5), prefix_cache=False)
    together = run_all(tight, reqs, steered=False)
    assert tight.steps.preemptions > 0
    for events, reference in zip(together, alone, strict=True):
        assert events[-1].result.token_ids == reference.token_ids
    assert together[3][-1].result.text.startswith('{"name": "')


def test_reference_kernels_give_the_same_constrained_text(chatty_tiny_dir, engine):
    reference = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, kernels="reference")
    for structured in (schema_output(), StructuredOutput("regex", r"[A-Z][a-z]{2,6}-\d{3}")):
        fast = run(engine, request(structured=structured, max_tokens=60))
        plain = run(reference, request(structured=structured, max_tokens=60))
        assert plain.text == fast.text and plain.finish_reason == fast.finish_reason == "stop"


# -- the real default model ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_default_model_writes_json_that_validates_against_the_schema(default_engine, sampling):
    result = run(default_engine, request(structured=schema_output(), sampling=sampling, max_tokens=120), steered=False)
    assert result.finish_reason == "stop", result.text
    hotel = validates(result.text)
    assert hotel["kind"] in ("hotel", "ryokan", "hostel") and hotel["address"]["city"] in ("Kyoto", "Osaka")


@pytest.mark.slow
def test_the_default_model_follows_a_regex_and_a_choice(default_engine):
    pattern = r"\d{3}-\d{4}"
    phone = run(default_engine, request("The hotel's phone number?", structured=StructuredOutput("regex", pattern)))
    assert phone.finish_reason == "stop" and re.fullmatch(pattern, phone.text), phone.text
    choices = ("yes", "no")
    answer = run(default_engine, request("Is Kyoto in Japan?", structured=StructuredOutput("choice", choices=choices)))
    assert answer.finish_reason == "stop" and answer.text in choices


@pytest.mark.slow
def test_the_default_model_calls_the_required_and_the_named_tool(default_engine):
    prompt = "Show me wheelchair-accessible hotels in Kyoto"
    schemas = {t.name: json.loads(t.parameters) for t in (SEARCH, WEATHER)}
    required = request(prompt, tools=(SEARCH, WEATHER), tool_choice=ToolChoice("required"), parallel_tool_calls=False)
    named = request(prompt, tools=(SEARCH, WEATHER), tool_choice=ToolChoice("function", "get_weather"))
    for req in (required, named):
        result = run(default_engine, req)
        assert result.finish_reason == "stop", result.text
        (call,) = calls_in(result.text)
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    assert call["name"] == "get_weather"


@pytest.mark.slow
def test_the_default_models_constrained_text_is_the_same_in_a_batch_and_on_the_reference_kernels(
    default_model_dir, default_engine
):
    constrained = request(structured=schema_output(), max_tokens=120)
    alone = run(default_engine, constrained, steered=False)
    assert alone.finish_reason == "stop"
    others = [
        request("Tell me about Osaka", max_tokens=40),
        request("Name a ryokan", structured=StructuredOutput("regex", r"[A-Z][a-z]{3,9}")),
        request("Hi", max_tokens=30, sampling=SAMPLED),
    ]
    together = run_all(default_engine, [constrained, *others], steered=False)
    assert together[0][-1].result.text == alone.text
    assert any(isinstance(e, TokenEvent) and e.batch is not None and e.batch.sequences > 1 for e in together[0])
    reference = Engine(default_model_dir, device="cpu", dtype="float32", kv_budget_bytes=1 << 30, kernels="reference")
    assert run(reference, constrained).text == alone.text
