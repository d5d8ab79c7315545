"""Token log probabilities, and their two OpenAI wire formats.

Chat completions report one entry per token under `logprobs.content`: the token, its log
probability, its UTF-8 bytes and `top_logprobs`, the likeliest alternatives at that step.
Plain completions use the older parallel lists (`tokens`, `token_logprobs`, `top_logprobs` as
token -> logprob maps, `text_offset`). The server writes both; the endpoint client reads the
chat format back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# JSON has no -Infinity; OpenAI-compatible servers report an impossible token this way.
IMPOSSIBLE_LOGPROB = -9999.0


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token at a step."""

    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token of one step, its log probability and the likeliest alternatives."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


def finite_logprob(value: float) -> float:
    """`value`, or IMPOSSIBLE_LOGPROB where it is -inf or NaN (JSON cannot carry those)."""
    return value if math.isfinite(value) else IMPOSSIBLE_LOGPROB


def _token_json(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs_json(entries: Sequence[TokenLogprob]) -> dict:
    """The `logprobs` object of a chat completion choice (or chunk choice)."""
    content = []
    for entry in entries:
        item = _token_json(entry.token, entry.logprob)
        item["top_logprobs"] = [_token_json(t.token, t.logprob) for t in entry.top]
        content.append(item)
    return {"content": content}


def completion_logprobs_json(entries: Sequence[TokenLogprob], text_offset: int) -> dict:
    """The `logprobs` object of a plain completion choice; offsets start at `text_offset`."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [finite_logprob(e.logprob) for e in entries],
        "top_logprobs": [{t.token: finite_logprob(t.logprob) for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def parse_chat_logprobs(raw: object) -> tuple[TokenLogprob, ...]:
    """Entries from a chat choice's `logprobs` object; anything malformed is skipped."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not isinstance(content, list):
        return ()
    entries = []
    for item in content:
        parsed = _parse_pair(item)
        if parsed is None:
            continue
        tops = item.get("top_logprobs") if isinstance(item.get("top_logprobs"), list) else []
        alternatives = tuple(TopLogprob(*pair) for pair in map(_parse_pair, tops) if pair is not None)
        entries.append(TokenLogprob(parsed[0], parsed[1], alternatives))
    return tuple(entries)


def _parse_pair(item: object) -> tuple[str, float] | None:
    if not isinstance(item, dict):
        return None
    token, logprob = item.get("token"), item.get("logprob")
    if not isinstance(token, str) or isinstance(logprob, bool) or not isinstance(logprob, int | float):
        return None
    return token, float(logprob)
