"""OpenAI's `logit_bias` read into the sampler's (token id, bias) pairs."""

from __future__ import annotations

import math

from minengine.sampling.params import MAX_LOGIT_BIAS
from reqscope.openai.errors import invalid, shown

MAX_BIASED_TOKENS = 1024  # a request biases a few tokens, not a vocabulary


def parse_logit_bias(raw: object, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """`{"token id": bias}` as (id, bias) pairs, ids ascending; each id within the vocabulary
    (when its size is known) and each bias within [-100, 100]."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise invalid(
            "logit_bias", f'logit_bias must be an object of token ids to biases, {{"15339": -100}} (got {shown(raw)})'
        )
    if len(raw) > MAX_BIASED_TOKENS:
        raise invalid("logit_bias", f"logit_bias holds at most {MAX_BIASED_TOKENS} tokens (got {len(raw)})")
    high = None if vocab_size is None else vocab_size - 1
    pairs: dict[int, float] = {}
    for key, value in raw.items():
        text = key.strip() if isinstance(key, str) else ""
        if not text.isdecimal():
            raise invalid("logit_bias", f"logit_bias key {shown(key)} must be a token id, a whole number >= 0 as text")
        token_id = int(text)
        if high is not None and token_id > high:
            raise invalid("logit_bias", f"logit_bias key {token_id} is outside the vocabulary (0..{high})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise invalid("logit_bias", f"logit_bias[{key!r}] must be a number (got {shown(value)})")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise invalid(
                "logit_bias",
                f"logit_bias[{key!r}] must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g} (got {value})",
            )
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))
