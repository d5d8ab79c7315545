"""Tools through `reqscope serve` on the real default model: the Kyoto prompt with `search_hotels`,
forced by `tool_choice` (a grammar), read back as OpenAI's `tool_calls` by the official client,
streamed in vLLM's delta shape; `auto` read from free text; bad tools refused with `param`."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI
from serve_harness import KEY, MODEL, authorized, chat_body, raw_request, refused_at_the_door, serving, sse_payloads

from minengine.engine.engine import Engine
from reqscope.cli import build_parser, main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KYOTO = "Show me wheelchair-accessible hotels in Kyoto"
TOOLS = json.loads((EXAMPLES / "search_hotels.json").read_text())
PARAMETERS = TOOLS[0]["function"]["parameters"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
# Room for one search_hotels call (about 60 tokens on the default model) and its end of turn.
CALL_TOKENS = 120


@pytest.fixture(scope="module")
def engine(default_model_dir):
    """The real default model: a forced call's arguments are its own words, under the grammar."""
    return Engine(default_model_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20)


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=300)


def kyoto(**fields) -> dict:
    return {"messages": [{"role": "user", "content": KYOTO}], "temperature": 0, **fields}


def test_required_tool_call_non_streaming_and_streaming(client):
    fields = kyoto(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=CALL_TOKENS)
    whole = client.chat.completions.create(model=MODEL, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "search_hotels"
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)

    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **fields))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    opening, rest = deltas[0], deltas[1:]
    assert opening.index == 0 and opening.id.startswith("call_") and opening.type == "function"
    assert opening.function.name == "search_hotels" and opening.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == call.function.arguments  # greedy: the same call
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_named_function_is_the_one_called(client):
    choice = client.chat.completions.create(
        model=MODEL,
        **kyoto(
            tools=[WEATHER, *TOOLS],
            tool_choice={"type": "function", "function": {"name": "search_hotels"}},
            max_tokens=CALL_TOKENS,
        ),
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["search_hotels"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), PARAMETERS)


def test_stream_deltas_have_vllms_shape_on_the_wire(served):
    named = {"type": "function", "function": {"name": "get_weather"}}  # a short call: {"city": ...}
    body = {"model": MODEL, **kyoto(tools=[WEATHER, *TOOLS], tool_choice=named), "max_tokens": 60, "stream": True}
    resp = raw_request(served.url, "POST", "/v1/chat/completions", body, authorized())
    assert resp.status == 200, resp.body
    events = [json.loads(p) for p in sse_payloads(resp.body)[:-1]]
    entries = [e for ev in events if ev["choices"] for e in ev["choices"][0]["delta"].get("tool_calls", [])]
    assert set(entries[0]) == {"index", "id", "type", "function"}
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(e == {"index": 0, "function": {"arguments": e["function"]["arguments"]}} for e in entries[1:])
    jsonschema.validate(
        json.loads("".join(e["function"]["arguments"] for e in entries)), WEATHER["function"]["parameters"]
    )
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_reads_a_call_out_of_free_text(client):
    """`auto` parses whatever text the model wrote: here a choice grammar makes it write a Hermes
    call after some content, so the reading is what is tested, not the model's mood."""
    call = '{"name": "get_weather", "arguments": {"city": "Kyoto"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    fields = kyoto(tools=[WEATHER, *TOOLS], max_tokens=40, extra_body={"structured_outputs": {"choice": [text]}})
    choice = client.chat.completions.create(model=MODEL, **fields).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    (made,) = choice.message.tool_calls
    assert made.function.name == "get_weather" and json.loads(made.function.arguments) == {"city": "Kyoto"}
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **fields))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me look.\n" and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments for d in deltas)) == json.loads(made.function.arguments)


def test_tool_choice_none_reads_no_calls(client):
    choice = client.chat.completions.create(
        model=MODEL, **kyoto(tools=TOOLS, tool_choice="none", max_tokens=4)
    ).choices[0]
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls


def test_a_tool_conversation_is_accepted(client):
    """An assistant turn with tool_calls (content null) and the tool's answer, as agents send them."""
    messages = [
        {"role": "user", "content": KYOTO},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "search_hotels", "arguments": '{"city": "Kyoto", "accessibility": []}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '[{"name": "Hotel Granvia"}]'},
    ]  # fmt: skip
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=3)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3


def _tool(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"tools": [_tool(description="no name")]}, "tools[0].function.name"),
        ({"tools": [_tool(name="has space")]}, "tools[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [_tool(name="f", parameters={"type": "string"})]}, "tools[0].function.parameters"),
        ({"tools": [_tool(name="f", parameters=[1])]}, "tools[0].function.parameters"),
        ({"tools": [_tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "nope"}}})]},
         "tools[0].function.parameters"),
        ({"tools": [*TOOLS, *TOOLS]}, "tools[1].function.name"),
        ({"tools": "search_hotels"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions"),
        ({"functions": [{"name": "f", "parameters": {"type": "integer"}}]}, "functions[0].parameters"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_are_400_naming_the_field(served, caplog, changes, param):
    error = refused_at_the_door(served, caplog, changes, param)
    assert param.split("[")[0] in error["message"]


def test_tools_on_completions_are_refused_by_name(served):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "tools": TOOLS}
    resp = raw_request(served.url, "POST", "/v1/completions", body, authorized())
    assert resp.status == 400 and resp.json()["error"]["param"] == "tools"
    assert "/v1/chat/completions" in resp.json()["error"]["message"]


def test_without_the_generic_block_tools_need_a_template_with_tool_syntax(engine, tmp_path):
    """SmolLM2's template has no tool syntax: with the generic block off, tools are a 400 naming
    `tools` (/tokenize too); a template file that has tool syntax takes them."""
    body = chat_body(KYOTO, tools=TOOLS, max_tokens=1)
    with serving(engine, generic_tools=False) as served:
        refused = raw_request(served.url, "POST", "/v1/chat/completions", body, authorized())
        tokenize = {"model": MODEL, "messages": body["messages"], "tools": TOOLS}
        counted = raw_request(served.url, "POST", "/tokenize", tokenize, authorized())
        plain = raw_request(served.url, "POST", "/v1/chat/completions", chat_body(KYOTO, max_tokens=1), authorized())
        assert plain.status == 200, plain.body
        template = tmp_path / "tools.jinja"
        template.write_text(
            "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
            "<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        original = (engine.tokenizer.chat_template, engine.tokenizer.template_origin)
        engine.tokenizer.use_chat_template_file(template)
        try:
            taken = raw_request(served.url, "POST", "/v1/chat/completions", body, authorized())
        finally:
            engine.tokenizer.chat_template, engine.tokenizer.template_origin = original
    for resp in (refused, counted):
        assert resp.status == 400, resp.body
        assert resp.json()["error"]["param"] == "tools" and "--no-generic-tools" in resp.json()["error"]["message"]
    assert taken.status == 200, taken.body


def test_serve_flags_for_templates_and_the_generic_block(monkeypatch, capsys, tmp_path):
    args = build_parser("serve").parse_args(["--chat-template", "t.jinja", "--no-generic-tools"])
    assert args.chat_template == "t.jinja" and args.generic_tools is False
    assert build_parser("serve").parse_args([]).generic_tools is True
    monkeypatch.delenv("REQSCOPE_API_KEY", raising=False)
    missing = tmp_path / "missing.jinja"
    code = main(["serve", "--model", "/nonexistent", "--chat-template", str(missing)])  # before any model opens
    err = capsys.readouterr().err
    assert code == 2 and str(missing) in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
