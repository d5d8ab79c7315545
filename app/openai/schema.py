"""OpenAI-style request bodies into GenerationRequests, and OpenAI-style errors.

This is the validating half of the gateway: every problem with a body becomes an ApiError
naming the offending field in `param`, answered with OpenAI's error object. Sampling
parameters follow vLLM's reading of them: `top_k` -1 or 0 and `min_p` 0 switch the stage off,
and `max_completion_tokens` wins over the older `max_tokens`. Of vLLM's extras, `ignore_eos`,
`min_tokens` and `stop_token_ids` are honoured (by the engine). Every other field is refused
by name rather than ignored: parameters that would change the output but are not implemented
(penalties, logit bias, tools, n > 1, beam search, guided decoding, ...) unless sent at their
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
from reqscope.wording import error_text

MAX_TOP_LOGPROBS = 20
SHOWN_CHARS = 64  # the most of a client's value an error message echoes
# OpenAI's default for /v1/completions; chat has no fixed default, so the server sets one.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROUTE = "/v1/chat/completions"

Kind = Literal["chat", "completion"]
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")

# Fields this server reads, for both routes and for each one.
_READ = frozenset(
    {
        "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "top_k", "min_p", "seed", "stop", "response_format", "logprobs",
        "ignore_eos", "min_tokens", "stop_token_ids",  # vLLM's extras the engine honours
    }
)  # fmt: skip
_READ_BY_KIND: dict[Kind, frozenset[str]] = {
    "chat": _READ | {"messages", "top_logprobs"},
    "completion": _READ | {"prompt"},
}
# Accepted and ignored: they label or route a request but cannot change its output.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})

# Accepted only at their neutral value: anything else would change the output unannounced.
_NEUTRAL: dict[str, object] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "best_of": 1,
    "echo": False,
    "logit_bias": None,
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
    "guided_whitespace_pattern": None,
    "structured_outputs": None,
    "top_a": 0,
    "typical_p": 1,
    "priority": 0,  # one queue, first come first served
}


class ApiError(Exception):
    """A request the API answers with an error status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.retry_after_s = retry_after_s
        # Answer, then close the connection without waiting for the rest of the body (a stall).
        self.close_connection = close_connection

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`, as OpenAI answers errors."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value`'s repr for an error message, cut to `limit` characters.

    Errors echo what the client sent so the mistake is visible, but a 100,000-character model
    name must not come back in full: the echo is for reading, not a copy of the request.
    """
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text)} characters)"


def invalid(param: str, message: str) -> ApiError:
    """A 400 naming `param`."""
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ParseOptions:
    """Server-side settings that shape every parsed request."""

    model_name: str
    sampler_order: tuple[str, ...]
    default_max_tokens: int = 256
    vocab_size: int | None = None  # bounds stop_token_ids when known


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
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid("response_format", "only plain text output is supported; leave response_format out")
    n = fields.integer("n", 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported (got {n}); send separate requests instead")
    if kind == "chat":
        messages, raw_prompt = _messages(body.get("messages")), None
        default_max = options.default_max_tokens
        top_logprobs = _chat_logprobs(fields)
    else:
        messages, raw_prompt = (), _prompt(body.get("prompt"))
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
        top_logprobs = fields.integer("logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    _refuse_unsupported(kind, body)  # after the route's own content, so a body sent to the wrong route says so
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
    )
    _check_sampling(sampling)
    try:
        validate(generation, vocab_size=options.vocab_size)
    except RequestError as exc:
        message = error_text(exc)
        raise ApiError(400, message, param=_field_named(message, kind)) from None
    return ApiRequest(kind, model, generation, stream, include_usage, top_logprobs)


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


def _messages(raw: object) -> tuple[Message, ...]:
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
        messages.append(Message(role, _content(item.get("content"), f"{where}.content")))
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
