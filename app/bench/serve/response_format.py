"""The structured output a benchmark asks for: `--response-format` and `--json-schema FILE`, as sent.

The request is the engine's own record, `StructuredOutput` (kind `json_object` or `json_schema`,
the schema as JSON text and its name), read from the flags and written into OpenAI's
`response_format` field, the form vLLM, llama-server and `reqscope serve` all take. A schema file
holds a JSON schema, or OpenAI's `json_schema` object around one (`{"name", "schema", "strict"}`);
it is checked against its metaschema when read, so a broken schema is a usage error before any
request goes out rather than a run of 400s.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from minengine.sampling.structured import StructuredOutput

FORMATS = ("json_object", "json_schema")
_NAME_SPILL = re.compile(r"[^A-Za-z0-9_-]+")  # OpenAI's json_schema.name: letters, digits, _ and -, at most 64


def json_schema_file(text: str) -> StructuredOutput:
    """argparse `type=` for `--json-schema FILE`: the schema read, checked, and named after the file."""
    path = Path(text).expanduser()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{text} is not JSON ({exc}); give a JSON schema file") from None
    name = _NAME_SPILL.sub("_", path.stem)[:64] or "schema"
    if isinstance(raw, dict) and isinstance(raw.get("schema"), dict) and isinstance(raw.get("name"), str):
        name, raw = raw["name"], raw["schema"]  # OpenAI's json_schema object around the schema
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"{text} holds a JSON {type(raw).__name__}, not a schema object")
    problem = schema_problem(raw)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text} is not a valid JSON schema: {problem}")
    return StructuredOutput("json_schema", spec=json.dumps(raw), name=name)


def schema_problem(schema: dict) -> str | None:
    """What makes `schema` invalid against its own metaschema (its `$schema`, else the latest draft), or None."""
    # Imported here, not at the top: only `bench serve --json-schema` needs it, and every other verb
    # that imports this package would otherwise pay for loading it.
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        return f"{exc.message} at {exc.json_path}"
    return None


def structured_from_flags(response_format: str | None, schema: StructuredOutput | None) -> StructuredOutput | None:
    """The structured output `--response-format` and `--json-schema` ask for together; None for plain text.

    `--json-schema` alone means `json_schema`; `json_schema` without a file, or a file beside
    `json_object`, is an error that names the flag to fix.
    """
    kind = response_format or ("json_schema" if schema is not None else None)
    if kind is None:
        return None
    if kind == "json_schema" and schema is None:
        raise ValueError("--response-format json_schema needs --json-schema FILE, the schema every answer must follow")
    if kind == "json_object" and schema is not None:
        raise ValueError("--json-schema goes with --response-format json_schema (json_object takes no schema)")
    return schema if kind == "json_schema" else StructuredOutput("json_object")


def response_format_field(structured: StructuredOutput) -> dict:
    """OpenAI's `response_format` for `structured`: strict, so the server holds every answer to the schema."""
    if structured.kind == "json_object":
        return {"type": "json_object"}
    if structured.kind == "json_schema":
        schema = json.loads(structured.spec)
        return {"type": "json_schema", "json_schema": {"name": structured.name, "schema": schema, "strict": True}}
    raise ValueError(f"bench serve sends json_object or json_schema, not {structured.kind}")
