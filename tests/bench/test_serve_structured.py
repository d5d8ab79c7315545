"""`reqscope bench serve --response-format/--json-schema`: what it sends, and every answer checked with jsonschema.

A fake OpenAI server on loopback streams known answers (one that follows the example hotel
schema, one outside its enum, one that is not JSON, one cut by max tokens, one refused); the
verdicts the client reports must be jsonschema's own on the same texts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import llguidance
import pytest
from aiohttp import web
from serve_harness import KEY, serving

from minengine.engine.engine import Engine
from reqscope.cli import main
from reqscope.serve.runner import start_in_thread

HOTEL_SCHEMA = Path(__file__).resolve().parents[2] / "examples" / "hotel_schema.json"
SMALL = ("--input-len", "16", "--output-len", "64", "--max-concurrency", "1")

GOOD = {
    "city": "Kyoto",
    "hotels": [
        {
            "name": "Hotel Granvia",
            "district": "Shimogyo",
            "accessibility": {"wheelchair": True, "step_free_entrance": True},
            "price_per_night": 21000,
        }
    ],
}
OFF_ENUM = {**GOOD, "hotels": [{**GOOD["hotels"][0], "district": "Gion"}]}


@dataclass(frozen=True)
class Answer:
    """What the fake streams for one request: the text, in three chunks, and how it ends."""

    text: str
    finish_reason: str = "stop"
    refused: bool = False  # a 400 instead of a stream


@dataclass
class Fake:
    answers: tuple[Answer, ...]
    bodies: list[dict] = field(default_factory=list)


def _event(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def _fake_app(fake: Fake) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        answer = fake.answers[len(fake.bodies) % len(fake.answers)]
        fake.bodies.append(body)
        if answer.refused:
            error = {"message": "schema refused", "type": "BadRequestError", "param": "response_format"}
            return web.json_response({"error": error}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        third = max(1, len(answer.text) // 3)
        pieces = [answer.text[:third], answer.text[third : 2 * third], answer.text[2 * third :]]
        for i, piece in enumerate(pieces):
            finish = answer.finish_reason if i == len(pieces) - 1 else None
            choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            await resp.write(_event({"choices": [choice]}))
        usage = {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}
        await resp.write(_event({"choices": [], "usage": usage}))
        await resp.write(_event("[DONE]"))
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


@contextmanager
def fake_server(fake: Fake) -> Iterator[str]:
    server = start_in_thread(_fake_app(fake))
    try:
        yield server.url
    finally:
        server.stop()


def bench_serve(capsys, url: str, tokenizer_dir: Path, prompts: int, *flags: str) -> tuple[int, str, str]:
    code = main([
        "bench", "serve", "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", "m",
        "--tokenizer", str(tokenizer_dir), "--num-prompts", str(prompts), *SMALL, *flags,
    ])  # fmt: skip
    out, err = capsys.readouterr()
    return code, out, err


def jsonschema_says(text: str, schema: dict) -> bool:
    """The reference: does `text` parse and validate against `schema`?"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema.validators.validator_for(schema)(schema).is_valid(value)


# -- what is sent ----------------------------------------------------------------------------------


def test_every_request_carries_the_schema_strict_and_ends_at_its_end_of_turn(capsys, default_model_dir):
    fake = Fake((Answer(json.dumps(GOOD)),))
    schema = json.loads(HOTEL_SCHEMA.read_text())
    with fake_server(fake) as url:
        code, out, _ = bench_serve(capsys, url, default_model_dir, 3, "--json-schema", str(HOTEL_SCHEMA), "--json")
    assert code == 0 and json.loads(out)["valid_answers"] == 3
    for body in fake.bodies:
        assert body["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "hotel_schema", "schema": schema, "strict": True},
        }
        # ignore_eos would run a finished answer on past its JSON: off unless asked for.
        assert "ignore_eos" not in body and body["stream"] is True


def test_ignore_eos_still_goes_when_asked_for_and_a_plain_run_sends_no_format(capsys, default_model_dir):
    fake = Fake((Answer('{"a": 1}'),))
    with fake_server(fake) as url:
        code, _, _ = bench_serve(capsys, url, default_model_dir, 1, "--response-format", "json_object", "--ignore-eos")
        plain_code, plain, _ = bench_serve(capsys, url, default_model_dir, 1, "--json")
    assert code == plain_code == 0
    assert fake.bodies[0]["response_format"] == {"type": "json_object"} and fake.bodies[0]["ignore_eos"] is True
    assert "response_format" not in fake.bodies[1] and fake.bodies[1]["ignore_eos"] is True
    result = json.loads(plain)
    assert "valid_answers" not in result and "generated_texts" not in result  # no text kept, none checked


def test_a_file_in_openais_json_schema_form_keeps_its_name(capsys, default_model_dir, tmp_path):
    schema = json.loads(HOTEL_SCHEMA.read_text())
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"name": "kyoto_hotels", "schema": schema, "strict": True}))
    fake = Fake((Answer(json.dumps(GOOD)),))
    with fake_server(fake) as url:
        code, out, _ = bench_serve(capsys, url, default_model_dir, 1, "--json-schema", str(wrapped))
    assert code == 0
    assert fake.bodies[0]["response_format"]["json_schema"] == {
        "name": "kyoto_hotels",
        "schema": schema,
        "strict": True,
    }
    assert 'Response format:                         json_schema "kyoto_hotels"' in out


# -- every answer checked --------------------------------------------------------------------------


def test_each_answer_gets_jsonschemas_verdict_and_a_cut_one_is_counted_apart(capsys, default_model_dir, tmp_path):
    schema = json.loads(HOTEL_SCHEMA.read_text())
    answers = (
        Answer(json.dumps(GOOD, indent=2)),
        Answer(json.dumps(OFF_ENUM)),
        Answer("Here are some hotels in Kyoto: Granvia"),
        Answer(json.dumps(GOOD)[:40], finish_reason="length"),
        Answer("", refused=True),
        Answer(json.dumps(GOOD)),
    )
    saved = tmp_path / "result.json"
    fake = Fake(answers)
    with fake_server(fake) as url:
        code, out, _ = bench_serve(
            capsys, url, default_model_dir, 6, "--response-format", "json_schema", "--json-schema", str(HOTEL_SCHEMA),
            "--output", str(saved),
        )  # fmt: skip
    assert code == 0
    result = json.loads(saved.read_text())
    assert (result["completed"], result["failed"]) == (5, 1)
    # The reference: jsonschema on the texts the fake sent (the cut one and the refused one have no verdict of it).
    reference = [jsonschema_says(a.text, schema) for a in answers]
    assert reference == [True, False, False, False, False, True]
    assert result["answer_verdicts"] == ["valid", "invalid", "invalid", "cut by length", "", "valid"]
    assert result["generated_texts"][:4] == [a.text for a in answers[:4]]  # streamed in pieces, joined back
    assert result["finish_reasons"] == ["stop", "stop", "stop", "length", "", "stop"]
    assert (result["valid_answers"], result["validated_answers"], result["cut_by_length"]) == (2, 4, 1)
    assert result["valid_share"] == 0.5 and result["response_format"] == "json_schema"
    assert result["json_schema_name"] == "hotel_schema"
    assert result["first_invalid_answer"].startswith("$.hotels[0].district: 'Gion' is not one of ['Higashiyama'")
    assert result["answer_problems"][2].startswith('not JSON (Expecting value at char 0): "Here are some hotels')
    # The summary says the same, beside vLLM's figures.
    assert "Valid answers:                           2 / 4 (50.0%)" in out
    assert "Cut by length:                           1" in out
    assert f"First invalid answer: {result['first_invalid_answer']}" in out
    assert 'Response format:                         json_schema "hotel_schema"' in out
    assert "Output token throughput (tok/s):" in out and "First error: HTTP 400: schema refused" in out


def test_json_object_answers_must_be_json_objects(capsys, default_model_dir):
    answers = (Answer('{"city": "Kyoto"}'), Answer("[1, 2]"), Answer('"Kyoto"'))
    fake = Fake(answers)
    with fake_server(fake) as url:
        code, out, _ = bench_serve(capsys, url, default_model_dir, 3, "--response-format", "json_object", "--json")
    result = json.loads(out)
    assert code == 0 and result["answer_verdicts"] == ["valid", "invalid", "invalid"]
    assert result["answer_problems"][1:] == ["a JSON list, not an object", "a JSON str, not an object"]
    assert result["json_schema_name"] is None and result["valid_share"] == pytest.approx(1 / 3)


def test_when_every_answer_is_cut_the_share_is_not_a_number(capsys, default_model_dir):
    fake = Fake((Answer('{"city": "Ky', finish_reason="length"),))
    with fake_server(fake) as url:
        code, out, _ = bench_serve(capsys, url, default_model_dir, 2, "--json-schema", str(HOTEL_SCHEMA))
    assert code == 0
    assert (
        "Valid answers:                           0 / 0 n/a" in out
        and "Cut by length:                           2" in out
    )
    assert "First invalid answer" not in out


def test_the_example_schema_nests_objects_in_an_array_with_an_enum_and_llguidance_compiles_it():
    schema = json.loads(HOTEL_SCHEMA.read_text())
    jsonschema.validators.validator_for(schema).check_schema(schema)
    hotel = schema["properties"]["hotels"]["items"]
    assert schema["properties"]["hotels"]["type"] == "array" and hotel["properties"]["district"]["enum"]
    assert hotel["properties"]["accessibility"]["type"] == "object"
    # The grammar library the engine uses takes it: a server's 400 would fail every request of a run.
    grammar = llguidance.LLMatcher.grammar_from_json_schema(HOTEL_SCHEMA.read_text())
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--response-format", "json_schema"], "--response-format json_schema needs --json-schema FILE"),
        (["--response-format", "json_object", "--json-schema", str(HOTEL_SCHEMA)], "--json-schema goes with"),
    ],
)
def test_flags_that_do_not_go_together_are_one_line_errors(capsys, default_model_dir, flags, says):
    code = main(["bench", "serve", "--model", "m", "--tokenizer", str(default_model_dir), *flags])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and says in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "is not JSON"),
        ('["a", "b"]', "holds a JSON list, not a schema object"),
        (
            '{"type": "hotel"}',
            "is not a valid JSON schema: 'hotel' is not valid under any of the given schemas at $.type",
        ),
        ('{"type": "object", "required": "name"}', "is not a valid JSON schema: 'name' is not of type 'array'"),
    ],
)
def test_a_bad_schema_file_is_a_one_line_usage_error(capsys, tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--json-schema", str(bad)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and says in err and "--json-schema" in err


def test_a_missing_schema_file_and_an_unknown_format_are_usage_errors(capsys, tmp_path):
    for flags, says in (
        (["--json-schema", str(tmp_path / "none.json")], "cannot read"),
        (["--response-format", "regex"], "invalid choice: 'regex'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "serve", *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and says in err


# -- against reqscope serve ------------------------------------------------------------------------

# Every answer this schema allows is short (enums, a boolean, at most two items, no free text), so a
# tiny random model's answers all end inside --output-len and each one is checked.
BOUNDED = {
    "type": "object",
    "properties": {
        "districts": {
            "type": "array",
            "items": {"enum": ["Higashiyama", "Nakagyo", "Shimogyo"]},
            "minItems": 1,
            "maxItems": 2,
        },
        "accessibility": {
            "type": "object",
            "properties": {"wheelchair": {"type": "boolean"}},
            "required": ["wheelchair"],
            "additionalProperties": False,
        },
    },
    "required": ["districts", "accessibility"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)
    with serving(engine) as s:
        yield s


def test_against_reqscope_serve_every_answer_follows_the_schema(capsys, served, chatty_tiny_dir, tmp_path):
    schema_file = tmp_path / "bounded.json"
    schema_file.write_text(json.dumps(BOUNDED))
    code = main([
        "bench", "serve", "--base-url", served.url, "--endpoint", "/v1/chat/completions", "--api-key", KEY,
        "--tokenizer", str(chatty_tiny_dir), "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "24",
        "--output-len", "64", "--json-schema", str(schema_file), "--json",
    ])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and (result["completed"], result["failed"]) == (4, 0), result["errors"]
    # A random model, held to the schema by the server's grammar: every answer ends, and jsonschema agrees.
    assert result["finish_reasons"] == ["stop"] * 4 and result["cut_by_length"] == 0
    assert all(jsonschema_says(text, BOUNDED) for text in result["generated_texts"])
    assert (result["valid_answers"], result["validated_answers"], result["valid_share"]) == (4, 4, 1.0)
