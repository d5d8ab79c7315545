"""vLLM's `/tokenize` and `/detokenize` bodies, read into records.

`/tokenize` takes `{"model"?, "prompt"}` (text as is) or `{"model"?, "messages", "tools"?,
"add_generation_prompt"?}` (rendered with the chat template, tools placed as a chat request's
are), with `return_token_strs` and `add_special_tokens`. `add_special_tokens` defaults to false on
both forms: reqscope serve feeds every prompt to its model without added special tokens, so the
default counts what the engine runs (vLLM's default for a plain prompt is true, which for a
tokenizer that adds a BOS counts one more). `/detokenize` takes `{"model"?, "tokens"}`.
Fields vLLM reads that would change the rendering (a per-request `chat_template`, its kwargs)
are refused by name, as on the completion routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.text.chat_template import Message
from minengine.text.tools import Tool
from reqscope.openai.errors import ApiError, invalid, shown
from reqscope.openai.schema import ParseOptions, parse_messages, refuse_tools_without_syntax
from reqscope.openai.tools import parse_tools

MAX_DETOKENIZE_TOKENS = 1 << 20
_COMMON = frozenset({"model", "return_token_strs", "add_special_tokens"})
_PROMPT_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "tools", "add_generation_prompt"}
# vLLM's chat fields accepted at their neutral value only.
_NEUTRAL: dict[str, object] = {
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
}


@dataclass(frozen=True)
class TokenizeRequest:
    """Text to tokenize: a prompt as is, or messages (and tools) through the chat template."""

    prompt: str | None  # None: `messages` are rendered
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...]
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    """Token ids to turn back into text."""

    tokens: tuple[int, ...]


def parse_tokenize(body: object, options: ParseOptions) -> TokenizeRequest:
    """Validate a `/tokenize` body; raise ApiError (400, or 404 for another model)."""
    body = _object(body, options)
    chat = "messages" in body
    if chat and "prompt" in body:
        raise invalid("prompt", "send either prompt or messages to /tokenize, not both")
    if not chat and "prompt" not in body:
        raise invalid("prompt", "/tokenize needs a prompt (text) or messages (a chat)")
    _refuse_unknown(body, _CHAT_FIELDS if chat else _PROMPT_FIELDS)
    if chat:
        messages, prompt = parse_messages(body.get("messages")), None
        tools = parse_tools(body)
        refuse_tools_without_syntax(tools, "tools", options)
    else:
        prompt, messages, tools = body.get("prompt"), (), ()
        if not isinstance(prompt, str):
            raise invalid("prompt", f"prompt must be a string (got {shown(prompt)})")
    return TokenizeRequest(
        prompt,
        messages,
        tools,
        add_generation_prompt=_boolean(body, "add_generation_prompt", True),
        add_special_tokens=_boolean(body, "add_special_tokens", False),
        return_token_strs=_boolean(body, "return_token_strs", False),
    )


def parse_detokenize(body: object, options: ParseOptions) -> DetokenizeRequest:
    """Validate a `/detokenize` body: every id a whole number within the vocabulary."""
    body = _object(body, options)
    _refuse_unknown(body, frozenset({"model", "tokens"}))
    raw = body.get("tokens")
    if not isinstance(raw, list):
        raise invalid("tokens", f"tokens must be a list of token ids (got {shown(raw)})")
    if len(raw) > MAX_DETOKENIZE_TOKENS:
        raise invalid("tokens", f"tokens holds at most {MAX_DETOKENIZE_TOKENS} ids (got {len(raw)})")
    high = None if options.vocab_size is None else options.vocab_size - 1
    for i, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise invalid(f"tokens[{i}]", f"tokens[{i}] must be a token id, a whole number >= 0 (got {shown(value)})")
        if high is not None and value > high:
            raise invalid(f"tokens[{i}]", f"tokens[{i}] = {value} is outside the vocabulary (0..{high})")
    return DetokenizeRequest(tuple(raw))


def _object(body: object, options: ParseOptions) -> dict:
    """The body as an object, for this server's model (`model` may be left out, as vLLM allows)."""
    if not isinstance(body, dict):
        raise invalid("body", "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != options.model_name:
        raise ApiError(
            404,
            f"the model {shown(model)} does not exist; this server serves {shown(options.model_name)}",
            param="model",
            code="model_not_found",
        )
    return body


def _refuse_unknown(body: dict, read: frozenset[str]) -> None:
    for name, value in body.items():
        if name in read or (name in _NEUTRAL and value in (None, _NEUTRAL[name], {})):
            continue
        label = name if name.isidentifier() and len(name) <= 64 else shown(name)
        raise invalid(label, f"{label} is not supported by this server's /tokenize; leave it out")


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false (got {shown(value)})")
    return value
