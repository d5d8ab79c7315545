"""How far another weight format moves a run's output: what each format measured, and per step
whether the top-1 tokens agree and the KL divergence between the two distributions.

Both formats run on the same prefix at every step: each is teacher-forced on the tokens of the
run on screen (`lockstep`), so step i's two distributions condition on the same i tokens even
after the formats' own top-1 choices part. The first step where those top-1 tokens differ is
where greedy decoding in the two formats would part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepAgreement:
    """One decode step seen by both formats, on the same prefix."""

    index: int  # 0-based, among generated tokens
    baseline_top1: int
    other_top1: int
    kl: float  # KL(baseline || other) in nats, over the full vocabulary

    @property
    def agrees(self) -> bool:
        """True when both formats' most likely next token is the same."""
        return self.baseline_top1 == self.other_top1


def step_agreement(index: int, baseline_logits: torch.Tensor, other_logits: torch.Tensor) -> StepAgreement:
    """Compare two formats' next-token logits for one step (any shape ending in the vocabulary)."""
    # float64: in float32 each log-probability carries ~1e-6 of rounding, as large as fp16's whole KL
    a = torch.log_softmax(baseline_logits.detach().double().reshape(-1), dim=-1)
    b = torch.log_softmax(other_logits.detach().double().reshape(-1), dim=-1)
    kl = float((a.exp() * (a - b)).sum())
    return StepAgreement(index, int(a.argmax()), int(b.argmax()), max(kl, 0.0))


@dataclass(frozen=True)
class FormatRun:
    """What one format's run of the request measured, on the engine's clock (held time left out)."""

    format: str
    why: str  # how the engine came to this format ("asked for", "auto: ...")
    tokens: int
    ttft_ms: float | None
    decode_tokens_per_s: float | None
    weight_bytes_per_step: int | None  # the projections and the embedding row a decode step reads
    bytes_per_step: float | None  # weights plus KV, mean over the decode steps


@dataclass(frozen=True)
class EngineCost:
    """What holding another format's engine costs this process."""

    load_ms: float
    weight_bytes: int  # what its model holds (weights in their format, the embedding)
    rss_bytes: int  # this process's resident memory once it has loaded (the explorer's engine too)


@dataclass(frozen=True)
class FormatComparison:
    """The run on screen's tokens through two formats: each one's figures, and step by step how far apart."""

    request_id: str  # the run on screen whose tokens both formats were forced on
    baseline: FormatRun
    other: FormatRun
    steps: tuple[StepAgreement, ...]
    planned_steps: int  # the tokens of the run on screen
    cost: EngineCost | None  # None when the other format's engine was already loaded
    finished: bool

    @property
    def first_parting(self) -> int | None:
        """The first step whose top-1 tokens differ (None while they all agree)."""
        return next((s.index for s in self.steps if not s.agrees), None)

    @property
    def agreeing(self) -> int:
        """Steps whose top-1 tokens agree."""
        return sum(s.agrees for s in self.steps)

    @property
    def mean_kl(self) -> float | None:
        """Mean KL over the steps compared (None before the first)."""
        return sum(s.kl for s in self.steps) / len(self.steps) if self.steps else None

    @property
    def max_kl(self) -> float | None:
        """Largest KL of one step (None before the first)."""
        return max((s.kl for s in self.steps), default=None)
