"""Sampling parameters and the order in which the filter stages run.

The same four knobs mean different things in different engines because each engine chains the
stages in its own order: a top-p cut made before temperature scaling (llama.cpp) keeps another
set of tokens than one made after it (Hugging Face). The order is therefore a parameter too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from minengine.errors import RequestError

SAMPLER_STAGES: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p")

# transformers, GenerationMixin._get_logits_processor (generation/utils.py, checked in 5.x):
# the warpers are appended as Temperature, TopK, TopP, MinP (TopH/Typical/Epsilon/Eta after).
HF_ORDER: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p")

# llama.cpp, common/common.h, common_params_sampling::samplers default chain: penalties, dry,
# top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature, then dist. Temperature comes last,
# so top_p and min_p judge the unscaled distribution.
LLAMA_CPP_ORDER: tuple[str, ...] = ("top_k", "top_p", "min_p", "temperature")

# vLLM V1, vllm/v1/sample/sampler.py Sampler.sample: temperature, then the argmax-invariant
# logits processors (min_p is the built-in one, logits_processor/builtin.py), then
# TopKTopPSampler (top-k, then top-p on what is left). The removed V0 sampler ran
# temperature -> top-k/top-p -> min-p instead, which is the Hugging Face order.
VLLM_ORDER: tuple[str, ...] = ("temperature", "min_p", "top_k", "top_p")

NAMED_ORDERS: dict[str, tuple[str, ...]] = {
    "hf": HF_ORDER,
    "llama.cpp": LLAMA_CPP_ORDER,
    "vllm": VLLM_ORDER,
}

# Below this a positive temperature only magnifies float noise; 0 is the way to ask for greedy.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit value
# vLLM's SamplingParams._verify_args: presence and frequency in [-2, 2], repetition in (0, 2];
# OpenAI's logit_bias values in [-100, 100].
MAX_ADDITIVE_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits of one decode step.

    Construction does not check values, so a gateway can build one from untrusted input and
    report every problem through `validate()`.
    """

    temperature: float = 1.0  # 0 means greedy (argmax of raw logits)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    order: tuple[str, ...] = HF_ORDER
    # The stages before the filters, always in vLLM's order (the grammar's mask, min_tokens, then
    # these): logit bias, then the penalties. `repetition_penalty` covers prompt and output as
    # transformers' RepetitionPenaltyLogitsProcessor does; `frequency_penalty` and
    # `presence_penalty` count the output only, as OpenAI and vLLM define them.
    repetition_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending

    @property
    def adjusts_logits(self) -> bool:
        """Whether any stage before the filters (bias, penalties) is on."""
        return (
            bool(self.logit_bias)
            or self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
        )

    @property
    def greedy(self) -> bool:
        """True when the step is a plain argmax and no stage or random draw matters."""
        return self.temperature == 0

    def validate(self) -> None:
        """Raise RequestError naming the first field outside its allowed range."""
        t = _number("temperature", self.temperature)
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise RequestError(
                f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
                f"{MAX_TEMPERATURE:g}; got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off); got {self.top_k!r}")
        p = _number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1] (1 = off); got {self.top_p!r}")
        m = _number("min_p", self.min_p)
        if not 0 <= m <= 1:
            raise RequestError(f"min_p must be in [0, 1] (0 = off); got {self.min_p!r}")
        r = _number("repetition_penalty", self.repetition_penalty)
        if not 0 < r <= MAX_REPETITION_PENALTY:
            raise RequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off); "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = _number(name, getattr(self, name))
            if not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
                raise RequestError(
                    f"{name} must be between {-MAX_ADDITIVE_PENALTY:g} and {MAX_ADDITIVE_PENALTY:g} (0 = off); "
                    f"got {getattr(self, name)!r}"
                )
        _check_logit_bias(self.logit_bias)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_LIMIT):
            raise RequestError(f"seed must be an integer in [0, 2**64) or None; got {self.seed!r}")
        _check_order(self.order)

    def with_(self, **changes: object) -> SamplingParams:
        """A copy with `changes` applied (not validated; call validate() before use)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            names = ", ".join(f.name for f in dataclasses.fields(self))
            raise RequestError(f"unknown sampling parameter {unknown[0]!r}; known: {names}")
        return dataclasses.replace(self, **changes)

    @staticmethod
    def parse_order(text: str) -> tuple[str, ...]:
        """An order from a name in NAMED_ORDERS or a comma list of all four stage names."""
        key = text.strip().lower()
        if key in NAMED_ORDERS:
            return NAMED_ORDERS[key]
        order = tuple(part.strip().replace("-", "_") for part in key.split(","))
        _check_order(order)
        return order


def _check_order(order: object) -> None:
    if not isinstance(order, tuple) or sorted(map(str, order)) != sorted(SAMPLER_STAGES):
        shown = ",".join(map(str, order)) if isinstance(order, tuple | list) else repr(order)
        raise RequestError(
            f"sampler order must be one of {', '.join(NAMED_ORDERS)} or list each of "
            f"{','.join(SAMPLER_STAGES)} exactly once; got {shown!r}"
        )


def _check_logit_bias(bias: object) -> None:
    """Ranges only; the ids against the vocabulary are the engine's to check (it knows its size)."""
    if not isinstance(bias, tuple):
        raise RequestError(f"logit_bias must be a tuple of (token id, bias) pairs; got {bias!r}")
    for pair in bias:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise RequestError(f"logit_bias must hold (token id, bias) pairs; got {pair!r}")
        token_id, value = pair
        if not _is_int(token_id) or token_id < 0:
            raise RequestError(f"logit_bias key {token_id!r} must be a token id, a whole number >= 0")
        v = _number(f"logit_bias[{token_id}]", value)
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise RequestError(
                f"logit_bias[{token_id}] must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}; got {value!r}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number; got {value!r}")
    return float(value)
