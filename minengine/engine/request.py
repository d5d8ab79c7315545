"""A generation request and the gateway's validation of it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from minengine.errors import RequestError
from minengine.kv.usage import KV_DTYPE_ALIASES, KV_DTYPES, KV_LAYOUTS
from minengine.sampling.params import SamplingParams
from minengine.sampling.structured import StructuredOutput
from minengine.text.chat_template import ROLES, Message
from minengine.text.tools import Tool, ToolChoice

MAX_PAYLOAD_BYTES = 1 << 20  # message text accepted by the gateway
MAX_STOP_STRINGS = 8
MAX_STOP_TOKEN_IDS = 256  # like MAX_STOP_STRINGS: a request names a few stop tokens, not a vocabulary


@dataclass(frozen=True)
class SettingSource:
    """Where one setting of a request came from, for display: "flag", a model file, or a default."""

    name: str  # "temperature", "top_k", "top_p", "min_p", "seed", "max_tokens"
    source: str  # "flag", "generation_config.json" or "reqscope default"


def setting_value(request: GenerationRequest, name: str) -> float | int | None:
    """The value in force for a setting that `SettingSource.name` names."""
    return request.max_tokens if name == "max_tokens" else getattr(request.sampling, name)


def settings_line(request: GenerationRequest) -> str:
    """`temperature 0.7 (reqscope default), top_k 20 (generation_config.json), ...`, or ""."""
    return ", ".join(f"{s.name} {setting_value(request, s.name)} ({s.source})" for s in request.setting_sources)


@dataclass(frozen=True)
class GenerationRequest:
    """One chat request with everything that decides how it runs."""

    messages: tuple[Message, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    kv_layout: str = "gqa"
    kv_dtype: str = "auto"
    block_size: int = 16
    trace: bool = True  # record a sampler trace (top candidates) for every step
    top_n: int = 20
    # Text fed to the model as is, without the chat template (a plain completion); `messages`
    # is then empty.
    raw_prompt: str | None = None
    request_id: str = field(default_factory=lambda: "req-" + uuid.uuid4().hex[:12])
    # vLLM's extras. `ignore_eos`: end-of-sequence tokens do not end the request, so it runs to
    # max_tokens (benchmarks use it for fixed-length outputs).
    ignore_eos: bool = False
    # Until this many tokens are generated, EOS and `stop_token_ids` have their logits masked
    # to -inf (vLLM's MinTokensLogitsProcessor) and stop strings do not end the request.
    min_tokens: int = 0
    # Token ids that end the request as EOS does (finish "stop"); like EOS, they add no text.
    stop_token_ids: tuple[int, ...] = ()
    # Where each sampling value came from (shown in the header, --json and --plain); empty when
    # the caller did not say (a server request, a test).
    setting_sources: tuple[SettingSource, ...] = ()
    # The functions the model may call, and how it may choose among them (OpenAI's fields).
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    # When the model's template has no tool syntax, reqscope writes the tools into a system block
    # of its own (labelled as such); False refuses such a request instead.
    generic_tools: bool = True
    # The shape the output must take, enforced by a grammar (None: free text).
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # One name per storage type from here on (events, exports, the UI), whichever was asked.
        object.__setattr__(self, "kv_dtype", KV_DTYPE_ALIASES.get(self.kv_dtype, self.kv_dtype))

    @classmethod
    def from_prompt(cls, prompt: str, system: str | None = None, **kwargs) -> GenerationRequest:
        """A request with one user message (and an optional system message)."""
        messages = ((Message("system", system),) if system else ()) + (Message("user", prompt),)
        return cls(messages=messages, **kwargs)

    @classmethod
    def from_text(cls, text: str, **kwargs) -> GenerationRequest:
        """A plain-completion request: `text` is tokenized as is, with no chat template."""
        return cls(messages=(), raw_prompt=text, **kwargs)

    def with_(self, **changes) -> GenerationRequest:
        """A copy with some fields changed."""
        return replace(self, **changes)


def validate(
    request: GenerationRequest, max_payload_bytes: int = MAX_PAYLOAD_BYTES, vocab_size: int | None = None
) -> None:
    """The gateway's checks; raises RequestError naming the first bad field.

    `vocab_size`, when known, bounds `stop_token_ids` and `logit_bias`'s ids.
    """
    if request.raw_prompt is not None:
        if not request.raw_prompt.strip():
            raise RequestError("the prompt is empty; give some text to send")
        size = len(request.raw_prompt.encode("utf-8"))
    else:
        size = _messages_size(request.messages)
    if size > max_payload_bytes:
        raise RequestError(f"the prompt text is {size} bytes, over the {max_payload_bytes}-byte payload limit")
    if request.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1 (got {request.max_tokens})")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(request.stop)})")
    if not 0 <= request.min_tokens <= request.max_tokens:
        raise RequestError(
            f"min_tokens must be between 0 and max_tokens ({request.max_tokens}) (got {request.min_tokens})"
        )
    _check_stop_token_ids(request.stop_token_ids, vocab_size)
    if request.kv_layout not in KV_LAYOUTS:
        raise RequestError(f"kv layout {request.kv_layout!r} is unknown; use {' or '.join(KV_LAYOUTS)}")
    if request.kv_dtype not in KV_DTYPES:
        raise RequestError(f"kv dtype {request.kv_dtype!r} is unknown; use one of {', '.join(KV_DTYPES)}")
    if request.block_size < 1:
        raise RequestError(f"block size must be at least 1 (got {request.block_size})")
    request.sampling.validate()
    _check_logit_bias_ids(request.sampling.logit_bias, vocab_size)


def _check_stop_token_ids(ids: tuple[int, ...], vocab_size: int | None) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids (got {len(ids)})")
    high = None if vocab_size is None else vocab_size - 1
    for i, token_id in enumerate(ids):
        # bool is an int subclass; `true` as a token id is a client bug, not id 1.
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise RequestError(f"stop_token_ids[{i}] must be a token id, a whole number >= 0 (got {token_id!r})")
        if high is not None and token_id > high:
            raise RequestError(f"stop_token_ids[{i}] = {token_id} is outside the vocabulary (0..{high})")


def _check_logit_bias_ids(bias: tuple[tuple[int, float], ...], vocab_size: int | None) -> None:
    """The ids against the vocabulary (their form and the values' range are `SamplingParams.validate`'s)."""
    if vocab_size is None:
        return
    for token_id, _ in bias:
        if token_id >= vocab_size:
            raise RequestError(
                f"logit_bias key {token_id} is outside the vocabulary (0..{vocab_size - 1}); use ids the model has"
            )


def _messages_size(messages: tuple[Message, ...]) -> int:
    """Bytes of message text, after checking roles and that some user text exists."""
    if not messages:
        raise RequestError("the request has no messages; give a prompt")
    size = 0
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise RequestError(f"messages[{i}].role {msg.role!r} is unknown; use one of {', '.join(ROLES)}")
        size += len(msg.content.encode("utf-8"))
    if not any(m.content.strip() for m in messages if m.role == "user"):
        raise RequestError("the prompt is empty; give some text to send")
    return size
