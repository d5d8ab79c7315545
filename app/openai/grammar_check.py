"""Whether the grammar library can compile what a request asks for, checked at the door.

A schema, regex or grammar that llguidance cannot compile would otherwise fail inside the
engine; here it is a 400 naming the field. Two checks: `grammar_problem` compiles each field's
grammar without a tokenizer as the body is read (so the error names the very field, and a
tool's schema is checked even when no grammar will enforce it), and `door_check` compiles the
request's whole grammar against the model's tokenizer (`minengine.sampling.grammar.check`),
as the engine will.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Literal

from llguidance import LLMatcher, grammar_from

from minengine.errors import RequestError
from minengine.sampling import grammar as engine_grammar
from reqscope.openai.errors import ApiError, one_line
from reqscope.wording import error_text

if TYPE_CHECKING:
    from minengine.engine.request import GenerationRequest
    from minengine.text.tokenizer import ModelTokenizer

GrammarSource = Literal["json_schema", "regex", "grammar", "choice"]


def grammar_problem(source: GrammarSource, text: str) -> str | None:
    """Why `text` (a JSON schema as JSON text, a regex, Lark or GBNF text, or a JSON list of
    choices) does not compile, in one line; None when it does."""
    try:
        grammar = grammar_from(source, text)
        message = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        message = str(exc) or type(exc).__name__
    return one_line(message) if message else None


def needs_door_check(generation: GenerationRequest) -> bool:
    """Whether the request decodes under a grammar (structured output, or a tool it must call)."""
    return engine_grammar.needs_grammar(generation)


def door_check(generation: GenerationRequest, tokenizer: ModelTokenizer) -> None:
    """Compile the request's grammar against `tokenizer`; raise a 400 naming the field when it cannot."""
    try:
        engine_grammar.check(generation, tokenizer)
    except RequestError as exc:
        message = error_text(exc)
        raise ApiError(400, message, param=_param(message)) from None


def _param(message: str) -> str:
    """The request field an engine grammar message starts with (response_format's parts as the
    whole field, as OpenAI names it)."""
    match = re.match(r"[a-z_]+(\[\d+\])?(\.[a-z_]+)*", message)
    field = match.group(0) if match else "response_format"
    return "response_format" if field.startswith("response_format") or field == "json_object" else field
