"""What the endpoint client asks the server for beyond the messages: only what the user set.

A sampling flag the user did not give is left out of the request body, so the server's own
default applies (its generation_config, its command line, or the API's documented default);
the client never invents a value. Logprobs are off unless asked for: computing them costs the
server time per token (4x slower decode was seen with llama-cpp-python), and a measuring tool
must not disturb what it measures without saying so. Where they are asked for, every output
says so, with the cost where it can be measured.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from urllib.parse import urlsplit

# OpenAI's own API has deprecated `max_tokens` for `max_completion_tokens` (its reasoning models
# refuse the old name); vLLM, SGLang, llama.cpp and `reqscope serve` all read `max_tokens`.
OPENAI_HOST = "api.openai.com"

# The body field each setting fills, and its short name on the explorer's status line.
_SHORT = {"temperature": "T", "top_k": "k", "top_p": "p", "min_p": "min-p", "seed": "seed", "max_tokens": "max"}
LOGPROBS_COST_NOTE = "asking for logprobs can slow the server"


@dataclass(frozen=True)
class RequestSettings:
    """The sampling and logprob fields of one request; None leaves a field out of the body."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None  # sent as max_tokens, or max_completion_tokens to OpenAI
    top_logprobs: int | None = None  # None: no logprobs asked; N >= 0: logprobs with N alternatives

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestSettings:
        """The flags the user gave (the shared sampling flags default to None when not given).

        Each sampling field comes from the flag of its name; `top_logprobs` from `--logprobs`."""
        sampling = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "top_logprobs"}
        return cls(**sampling, top_logprobs=getattr(args, "logprobs", None))

    @property
    def logprobs(self) -> bool:
        """Whether the request asks the server for logprobs."""
        return self.top_logprobs is not None

    def sampling_fields(self) -> tuple[tuple[str, float | int | None], ...]:
        """(field, value) for each sampling field, in body order; None is left to the server."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "top_logprobs")

    def sent(self) -> tuple[tuple[str, float | int], ...]:
        """The sampling fields the body carries, with their values."""
        return tuple((name, value) for name, value in self.sampling_fields() if value is not None)

    def server_default(self) -> tuple[str, ...]:
        """The sampling fields left out of the body, so the server's defaults apply."""
        return tuple(name for name, value in self.sampling_fields() if value is None)

    def with_(self, **changes: object) -> RequestSettings:
        """A copy with `changes`."""
        return replace(self, **changes)


def token_limit_field(base_url: str) -> str:
    """The body field that carries max_tokens for this server: OpenAI's current name on OpenAI's host."""
    return "max_completion_tokens" if urlsplit(base_url).hostname == OPENAI_HOST else "max_tokens"


def logprobs_text(settings: RequestSettings) -> str:
    """"logprobs off", "logprobs on (top 3 per token)" or "logprobs on (the chosen token's only)"."""
    n = settings.top_logprobs
    if n is None:
        return "logprobs off"
    return "logprobs on (the chosen token's only)" if n == 0 else f"logprobs on (top {n} per token)"


def _value(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # :g would round a large seed


def settings_text(settings: RequestSettings, token_limit_field: str = "max_tokens") -> str:
    """The sampling sent and what was left to the server, by body field (plain mode, the panels)."""
    def field(name: str) -> str:
        return token_limit_field if name == "max_tokens" else name

    sent = ", ".join(f"{field(name)} {_value(value)}" for name, value in settings.sent())
    left = ", ".join(field(name) for name in settings.server_default())
    if not sent:
        return f"server default for all ({left})"
    return sent + (f"; server default: {left}" if left else "")


def short_settings(settings: RequestSettings) -> str:
    """The same in a few characters, for the explorer's status line: "T 0 max 12 · k p min-p seed: server default"."""
    parts = []
    for name, value in settings.sent():
        greedy = " (greedy)" if name == "temperature" and value == 0 else ""
        parts.append(f"{_SHORT[name]} {_value(value)}{greedy}")
    left = " ".join(_SHORT[name] for name in settings.server_default())
    if not parts:
        return "sampling: server default"
    return " ".join(parts) + (f" · {left}: server default" if left else "")
