"""Structured output through `reqscope serve` on the real default model: `response_format`
(json_schema, json_object) and vLLM's `structured_outputs` (regex, choice, grammar), every answer
checked against what was asked (`jsonschema`, `re`); what cannot compile is a 400 naming the
field, and vLLM's removed `guided_*` fields are refused with a hint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI
from serve_harness import KEY, MODEL, authorized, chat_body, raw_request, refused_at_the_door

from minengine.engine.engine import Engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HOTEL_SCHEMA = json.loads((EXAMPLES / "hotel_schema.json").read_text())
KYOTO = "Show me wheelchair-accessible hotels in Kyoto"
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "kind": {"enum": ["ryokan", "hotel", "hostel"]},
    },
    "required": ["city", "stars", "kind"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine(default_model_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20)


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=300)


def ask(client, text: str = KYOTO, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, **fields
    )


def test_json_schema_answer_validates(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "hotel_search", "schema": HOTEL_SCHEMA}}
    choice = ask(client, max_tokens=250, response_format=response_format).choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), HOTEL_SCHEMA)


def test_streamed_json_schema_answer_validates(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "stay", "schema": SMALL_SCHEMA, "strict": True}}
    chunks = list(ask(client, max_tokens=60, response_format=response_format, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SMALL_SCHEMA)


def test_structured_outputs_json_as_text_and_json_object(client):
    as_text = ask(client, max_tokens=60, extra_body={"structured_outputs": {"json": json.dumps(SMALL_SCHEMA)}})
    jsonschema.validate(json.loads(as_text.choices[0].message.content), SMALL_SCHEMA)
    any_object = ask(client, "Give the city Kyoto as a JSON object with the key city.", max_tokens=40,
                     response_format={"type": "json_object"})  # fmt: skip
    assert any_object.choices[0].finish_reason == "stop"
    assert json.loads(any_object.choices[0].message.content) == {"city": "Kyoto"}


def test_regex_choice_and_grammar(client, served):
    date = ask(client, "When should I check in?", max_tokens=20, extra_body={"structured_outputs": {"regex": DATE}})
    assert re.fullmatch(DATE, date.choices[0].message.content)
    choices = ["ryokan", "hotel", "hostel"]
    picked = ask(client, max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    assert picked.choices[0].message.content in choices
    lark = ask(client, max_tokens=10, extra_body={"structured_outputs": {"grammar": 'start: "Kyoto" | "Osaka"'}})
    gbnf = ask(client, max_tokens=10, extra_body={"structured_outputs": {"grammar": 'root ::= "Kyoto" | "Osaka"'}})
    assert lark.choices[0].message.content in ("Kyoto", "Osaka")
    assert gbnf.choices[0].message.content == lark.choices[0].message.content
    # /v1/completions takes them too.
    body = {"model": MODEL, "prompt": "Check-in date: ", "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"regex": DATE}}  # fmt: skip
    completion = raw_request(served.url, "POST", "/v1/completions", body, authorized())
    assert completion.status == 200, completion.body
    assert re.fullmatch(DATE, completion.json()["choices"][0]["text"])


def test_max_tokens_inside_the_structure_ends_with_length(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "hotel_search", "schema": HOTEL_SCHEMA}}
    choice = ask(client, max_tokens=4, response_format=response_format).choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 2]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+", "backend": "xgrammar"}}, "structured_outputs.backend"),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace"),
        ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_structured_output_is_400_naming_the_field(served, caplog, changes, param):
    error = refused_at_the_door(served, caplog, changes, param)
    assert param.split(".")[0] in error["message"]


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("guided_json", {"type": "object"}, '"json"'),
        ("guided_regex", "a+", '"regex"'),
        ("guided_choice", ["a", "b"], '"choice"'),
        ("guided_grammar", 'root ::= "a"', '"grammar"'),
        ("guided_decoding_backend", "xgrammar", "structured_outputs"),
        ("guided_whitespace_pattern", " ", "structured_outputs"),
    ],
)
def test_guided_fields_are_refused_with_a_hint(served, field, value, hint):
    for path, body in (("/v1/chat/completions", chat_body(max_tokens=2)),
                       ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 2})):  # fmt: skip
        resp = raw_request(served.url, "POST", path, {**body, field: value}, authorized())
        assert resp.status == 400, resp.body
        error = resp.json()["error"]
        assert error["param"] == field and "structured_outputs" in error["message"] and hint in error["message"]
