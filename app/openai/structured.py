"""The output's shape, as a request asks for it: OpenAI's `response_format` or vLLM 0.32's
`structured_outputs`, read into one `StructuredOutput`.

`response_format` takes `{"type": "text"}` (free text), `{"type": "json_object"}` and
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}`. `structured_outputs`
takes exactly one of `json` (a schema, as an object or as text), `regex`, `choice` (a list of
strings), `grammar` (Lark or GBNF) and `json_object: true`. Sending both is refused, as is
anything the grammar library cannot compile: both would otherwise fail, or be overridden,
silently. vLLM's removed `guided_*` fields are refused by name (vLLM 0.32 ignores them and
answers with free text).
"""

from __future__ import annotations

import json

from minengine.sampling.structured import StructuredOutput
from reqscope.openai.errors import invalid, shown
from reqscope.openai.grammar_check import GrammarSource, grammar_problem

GUIDED_FIELDS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern",
)  # fmt: skip
_GUIDED_HINT = {
    "guided_json": 'structured_outputs: {"json": SCHEMA}',
    "guided_regex": 'structured_outputs: {"regex": PATTERN}',
    "guided_choice": 'structured_outputs: {"choice": [...]}',
    "guided_grammar": 'structured_outputs: {"grammar": GRAMMAR}',
}
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the constraint: how its backends write JSON. The grammar library's own
# defaults stand; the options are accepted only at their neutral values.
_NEUTRAL_OPTIONS: dict[str, object] = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
    "disable_fallback": False,
}
MAX_CHOICES = 1024


def refuse_guided(body: dict) -> None:
    """A 400 naming the first of vLLM's removed `guided_*` fields the body sends."""
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            hint = _GUIDED_HINT.get(name, "structured_outputs")
            raise invalid(
                name,
                f"{name} was removed from vLLM (0.32 ignores it and answers with free text); send {hint} instead",
            )


def parse_structured(body: dict) -> StructuredOutput | None:
    """The request's constraint on its output, or None for free text."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    from_format = _response_format(response_format)
    from_structured = _structured_outputs(structured)
    if from_format is not None and from_structured is not None:
        raise invalid(
            "structured_outputs",
            "response_format and structured_outputs both constrain the output; send one of them",
        )
    return from_format or from_structured


def _response_format(raw: object) -> StructuredOutput | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid("response_format", f'response_format must be an object with a "type" (got {shown(raw)})')
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise invalid(
            "response_format",
            f'response_format.type {shown(kind)} is not supported; use "text", "json_object" or "json_schema"',
        )
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid(
            "response_format",
            'response_format of type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}',
        )
    name = spec.get("name", "")
    if not isinstance(name, str):
        raise invalid("response_format", "response_format.json_schema.name must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("response_format", "response_format.json_schema.strict must be true or false")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object, as json_object
        return StructuredOutput("json_object", name=name)
    # OpenAI names the whole field for a schema it cannot use; the message names the part.
    text = _schema_text(schema, "response_format.json_schema.schema", param="response_format")
    return StructuredOutput("json_schema", text, name=name)


def _structured_outputs(raw: object) -> StructuredOutput | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid("structured_outputs", f"structured_outputs must be an object (got {shown(raw)})")
    for key, value in raw.items():
        if key in _CONSTRAINTS:
            continue
        if key in _NEUTRAL_OPTIONS:
            if value is not None and value != _NEUTRAL_OPTIONS[key]:
                where = f"structured_outputs.{key}"
                raise invalid(where, f"{where} is not supported by this server; leave it out")
            continue
        where = f"structured_outputs.{key}" if key.isidentifier() and len(key) <= 64 else "structured_outputs"
        raise invalid(where, f"{where} is unknown; give one of {', '.join(_CONSTRAINTS)}")
    given = [key for key in _CONSTRAINTS if raw.get(key) is not None]
    if len(given) != 1:
        got = ", ".join(given) if given else "none"
        raise invalid(
            "structured_outputs", f"structured_outputs takes exactly one of {', '.join(_CONSTRAINTS)} (got {got})"
        )
    key = given[0]
    value, where = raw[key], f"structured_outputs.{key}"
    if key == "json_object":
        if value is not True:
            raise invalid(where, f"{where} must be true")
        return StructuredOutput("json_object")
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(where, f"{where} is not valid JSON: {exc.msg} (character {exc.pos})") from None
        return StructuredOutput("json_schema", _schema_text(value, where))
    if key == "choice":
        return StructuredOutput("choice", choices=_choices(value, where))
    if not isinstance(value, str) or not value:
        raise invalid(where, f"{where} must be a non-empty string")
    source: GrammarSource = "regex" if key == "regex" else "grammar"
    _compiles(source, value, where)
    return StructuredOutput("regex" if key == "regex" else "grammar", value)


def _schema_text(schema: object, where: str, param: str | None = None) -> str:
    if not isinstance(schema, dict | bool):
        raise invalid(param or where, f"{where} must be a JSON schema object (got {shown(schema)})")
    text = json.dumps(schema, ensure_ascii=False)
    _compiles("json_schema", text, where, param)
    return text


def _choices(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise invalid(where, f"{where} must be a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise invalid(where, f"{where} holds at most {MAX_CHOICES} choices (got {len(value)})")
    choices = tuple(value)
    _compiles("choice", json.dumps(list(choices)), where)
    return choices


def _compiles(source: GrammarSource, text: str, where: str, param: str | None = None) -> None:
    problem = grammar_problem(source, text)
    if problem is not None:
        what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}[source]
        raise invalid(param or where, f"{where} is not a {what} the grammar library can compile: {problem}")
