"""OpenAI-style request bodies into GenerationRequests, and OpenAI-style errors.

This is the validating half of the gateway: every problem with a body becomes an ApiError
naming the offending field in `param`, answered with OpenAI's error object. Sampling
parameters follow vLLM's reading of them: `top_k` -1 or 0 and `min_p` 0 switch the stage off,
and `max_completion_tokens` wins over the older `max_tokens`. Read and honoured besides:
`repetition_penalty`, `frequency_penalty`, `presence_penalty` and `logit_bias` (within vLLM's and
OpenAI's ranges, ids within the vocabulary); on chat, `tools` (or the older `functions`),
`tool_choice` (or `function_call`), `parallel_tool_calls` and messages carrying `tool_calls` or
answering one (`tools.py`); on both routes, `response_format` (text, json_object, json_schema) or
vLLM's `structured_outputs` (`structured.py`), each schema, regex and grammar compiled at the door
so that one the grammar library cannot build is a 400 here, not a failure inside the engine.
Of vLLM's extras, `ignore_eos`, `min_tokens` and `stop_token_ids` are honoured (by the engine).

Every other field is refused by name rather than ignored: vLLM's removed `guided_*` fields (with
a hint to send `structured_outputs`: vLLM 0.32 ignores them silently), parameters that would
change the output but are not implemented (n > 1, beam search, ...) unless sent at their
neutral value, and any field this server does not know, so that a typo or a feature another
server has never silently changes what the client gets. Only fields that cannot change the
output (`user`, `metadata`, ...) are accepted and ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from minengine.engine.request import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, GenerationRequest, validate
from minengine.errors import RequestError
from minengine.sampling.params import SamplingParams
from minengine.text.chat_template import ROLES, Message
from minengine.text.tools import Tool, ToolChoice
from reqscope.openai.errors import SHOWN_CHARS, ApiError, invalid, shown
from reqscope.openai.logit_bias import parse_logit_bias
from reqscope.openai.structured import parse_structured, refuse_guided
from reqscope.openai.tools import parse_tool_calls, parse_tool_choice, parse_tools
from reqscope.wording import error_text

__all__ = [
    "ApiError", "ApiRequest", "Kind", "ParseOptions", "invalid", "parse_messages", "parse_request",
    "refuse_tools_without_syntax", "shown",
]  # fmt: skip

MAX_TOP_LOGPROBS = 20
# OpenAI's default for /v1/completions; chat has no fixed default, so the server sets one.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROUTE = "/v1/chat/completions"

Kind = Literal["chat", "completion"]
_SAMPLING_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "seed",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
)  # fmt: skip

# Fields this server reads, for both routes and for each one.
_READ = frozenset(
    {
        "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "top_k", "min_p", "seed", "stop", "response_format", "logprobs",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
        "structured_outputs",
        "ignore_eos", "min_tokens", "stop_token_ids",  # vLLM's extras the engine honours
    }
)  # fmt: skip
_READ_BY_KIND: dict[Kind, frozenset[str]] = {
    "chat": _READ | {"messages", "top_logprobs", "tools", "tool_choice", "functions", "function_call"},
    "completion": _READ | {"prompt"},
}
# Accepted and ignored: they label or route a request but cannot change its output.
# (`parallel_tool_calls` is read on chat; on completions, which has no tools, it changes nothing.)
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})

# Accepted only at their neutral value: anything else would change the output unannounced.
_NEUTRAL: dict[str, object] = {
    "best_of": 1,
    "echo": False,
    # Read on chat; on completions (no tools there) only their absence is accepted.
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "suffix": None,
    # vLLM's sampling and decoding extras this engine does not implement.
    "use_beam_search": False,
    "length_penalty": 1,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,  # the engine always skips them
    "spaces_between_special_tokens": True,  # only matters when special tokens are shown
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "logits_processors": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,  # non-null guided_* are refused with a hint first (refuse_guided)
    "top_a": 0,
    "typical_p": 1,
    "priority": 0,  # one queue, first come first served
}


@dataclass(frozen=True)
class ParseOptions:
    """Server-side settings that shape every parsed request."""

    model_name: str
    sampler_order: tuple[str, ...]
    default_max_tokens: int = 256
    vocab_size: int | None = None  # bounds stop_token_ids and logit_bias ids when known
    template_tools: bool = True  # whether the model's chat template has tool syntax of its own
    # Without it, tools go into reqscope's own system block; False refuses such a request instead.
    generic_tools: bool = True


@dataclass(frozen=True)
class ApiRequest:
    """One validated call to /v1/chat/completions or /v1/completions."""

    kind: Kind
    model: str
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs asked for; 0: only the chosen token's


def parse_request(kind: Kind, body: object, request_id: str, options: ParseOptions) -> ApiRequest:
    """Validate `body` for `kind`; raise ApiError (400, or 404 for an unknown model)."""
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    fields = _Fields(body)
    model = fields.required_string("model")
    if model != options.model_name:
        raise ApiError(
            404,
            f"the model {shown(model)} does not exist; this server serves {shown(options.model_name)}",
            param="model",
            code="model_not_found",
        )
    n = fields.integer("n", 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported (got {n}); send separate requests instead")
    if kind == "chat":
        messages, raw_prompt = parse_messages(body.get("messages")), None
        default_max = options.default_max_tokens
        top_logprobs = _chat_logprobs(fields)
    else:
        messages, raw_prompt = (), _prompt(body.get("prompt"))
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
        top_logprobs = fields.integer("logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    refuse_guided(body)
    _refuse_unsupported(kind, body)  # after the route's own content, so a body sent to the wrong route says so
    tools, tool_choice, parallel = _tool_fields(kind, body, fields, options)
    structured = parse_structured(body)
    if structured is not None and tool_choice.forced:
        raise invalid(
            "tool_choice",
            f"tool_choice {tool_choice.mode!r} constrains the output to a tool call, which "
            f"{'response_format' if body.get('response_format') is not None else 'structured_outputs'} "
            "constrains too; send one of them",
        )
    stream = fields.boolean("stream", False)
    include_usage = _include_usage(body.get("stream_options"), stream)
    max_tokens = fields.integer("max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", default_max, low=1)
    top_k = fields.integer("top_k", 0, low=-1)
    sampling = SamplingParams(
        temperature=fields.number("temperature", 1.0),
        top_k=0 if top_k == -1 else top_k,
        top_p=fields.number("top_p", 1.0),
        min_p=fields.number("min_p", 0.0),
        seed=fields.integer("seed", None, low=0, high=2**64 - 1),
        order=options.sampler_order,
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        presence_penalty=fields.number("presence_penalty", 0.0),
        logit_bias=parse_logit_bias(body.get("logit_bias"), options.vocab_size),
    )
    generation = GenerationRequest(
        messages=messages,
        raw_prompt=raw_prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        trace=False,  # the server reports logprobs from the logits, not from sampler traces
        request_id=request_id,
        ignore_eos=fields.boolean("ignore_eos", False),
        min_tokens=fields.integer("min_tokens", 0, low=0),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        generic_tools=options.generic_tools,
        structured=structured,
    )
    _check_sampling(sampling)
    try:
        validate(generation, vocab_size=options.vocab_size)
    except RequestError as exc:
        message = error_text(exc)
        raise ApiError(400, message, param=_field_named(message, kind)) from None
    return ApiRequest(kind, model, generation, stream, include_usage, top_logprobs)


def _tool_fields(
    kind: Kind, body: dict, fields: _Fields, options: ParseOptions
) -> tuple[tuple[Tool, ...], ToolChoice, bool]:
    """The tools, the choice among them and whether calls may be parallel (none on completions)."""
    if kind != "chat":
        return (), ToolChoice("none"), True
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    parallel = fields.boolean("parallel_tool_calls", True)
    refuse_tools_without_syntax(tools, "functions" if body.get("functions") is not None else "tools", options)
    return tools, choice, parallel


def refuse_tools_without_syntax(tools: tuple[Tool, ...], param: str, options: ParseOptions) -> None:
    """A 400 naming `param` when tools meet a template without tool syntax and the generic block is off."""
    if tools and not options.template_tools and not options.generic_tools:
        raise invalid(
            param,
            f"{param} cannot be used with this model: its chat template has no tool syntax and the server "
            "runs with --no-generic-tools; leave them out, or serve a template with tool syntax (--chat-template)",
        )


def _refuse_unsupported(kind: Kind, body: dict) -> None:
    """A 400 naming the first field that is neither read, nor harmless, nor at its neutral value."""
    for name, value in body.items():
        if name in _READ_BY_KIND[kind] or name in _IGNORED:
            continue
        if name in _NEUTRAL and _is_neutral(value, _NEUTRAL[name]):
            continue
        # A client's key is echoed as it is only when it looks like a field name (one line, short).
        label = name if name.isidentifier() and len(name) <= SHOWN_CHARS else shown(name)
        other: Kind = "completion" if kind == "chat" else "chat"
        hint = ""
        if name in _READ_BY_KIND[other]:
            hint = f" on this route (it belongs to {'/v1/completions' if other == 'completion' else CHAT_ROUTE})"
        raise invalid(label, f"{label} is not supported by this server{hint}; leave it out")


def _field_named(message: str, kind: Kind) -> str | None:
    """The request field an engine validation message starts with (`min_tokens`, `stop_token_ids[2]`)."""
    match = re.match(r"([a-z_]+)(\[\d+\])?", message)
    return match.group(0) if match and match.group(1) in _READ_BY_KIND[kind] else None


def _is_neutral(value: object, neutral: object) -> bool:
    empty_container = isinstance(value, dict | list) and not value
    return value is None or empty_container or value == neutral


def _check_sampling(sampling: SamplingParams) -> None:
    """SamplingParams.validate, with the field it complains about named as `param`."""
    try:
        sampling.validate()
    except RequestError as exc:
        message = error_text(exc)
        param = next((name for name in _SAMPLING_FIELDS if message.startswith(name)), None)
        raise ApiError(400, message, param=param) from None


def _chat_logprobs(fields: _Fields) -> int | None:
    wanted = fields.boolean("logprobs", False)
    top = fields.integer("top_logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    return (top or 0) if wanted else None


def _include_usage(raw: object, stream: bool) -> bool:
    if raw is None:
        return False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(raw, dict):
        raise invalid("stream_options", "stream_options must be an object")
    value = raw.get("include_usage", False)
    if not isinstance(value, bool):
        raise invalid("stream_options.include_usage", "stream_options.include_usage must be true or false")
    return value


def parse_messages(raw: object) -> tuple[Message, ...]:
    """`messages`: roles, text content, tool calls on assistant turns, tool results."""
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    messages = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object with role and content")
        role = item.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role {shown(role)} is unknown; use one of {', '.join(ROLES)}")
        calls = parse_tool_calls(item.get("tool_calls"), f"{where}.tool_calls")
        if calls and role != "assistant":
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls belongs on an assistant message, not {role!r}")
        call_id, name = item.get("tool_call_id"), item.get("name")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string")
        if name is not None and not isinstance(name, str):
            raise invalid(f"{where}.name", f"{where}.name must be a string")
        content = _content(item.get("content"), f"{where}.content")
        messages.append(Message(role, content, calls, call_id if role == "tool" else None, name))
    return tuple(messages)


def _content(raw: object, where: str) -> str:
    """A message's text: a string, or a list of text parts joined together."""
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts = []
        for j, part in enumerate(raw):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{j}]", f"{where}[{j}] must be a text part ({{type: text, text: ...}})")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, f"{where} must be a string or a list of text parts")


def _prompt(raw: object) -> str:
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if not isinstance(raw, str):
        raise invalid("prompt", "prompt must be one string (token-id prompts and batches are not supported)")
    return raw


def _stop_token_ids(raw: object) -> tuple[int, ...]:
    """A list of whole numbers; their range is the engine's to check (it knows the vocabulary)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise invalid("stop_token_ids", f"stop_token_ids must be a list of token ids (got {shown(raw)})")
    if len(raw) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids (got {len(raw)})")
    ids = []
    for i, value in enumerate(raw):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            where = f"stop_token_ids[{i}]"
            raise invalid(where, f"{where} must be a token id, a whole number >= 0 (got {shown(value)})")
        ids.append(value)
    return tuple(ids)


def _stop(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stops)})")
    return tuple(stops)


class _Fields:
    """Typed reads of optional top-level fields, each failure naming its field."""

    def __init__(self, body: dict) -> None:
        self.body = body

    def required_string(self, name: str) -> str:
        value = self.body.get(name)
        if not isinstance(value, str) or not value:
            raise invalid(name, f"{name} is required and must be a string")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(name, f"{name} must be true or false (got {shown(value)})")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise invalid(name, f"{name} must be a number (got {shown(value)})")
        return float(value)

    def integer(self, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(name, f"{name} must be an integer (got {shown(value)})")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            raise invalid(name, f"{name} must be {bounds} (got {shown(value)})")
        return value
