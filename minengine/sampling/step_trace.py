"""The record of one decode step's choice: its top candidates and what the chain did to them.

Plain values, no tensors: `sampling.trace` builds these from a step's logits, and everything
downstream (events, the UI, a recorded trace, a replay) reads them without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.sampling.params import SamplingParams


@dataclass(frozen=True)
class Candidate:
    """One of the most likely tokens of a step, and what the chain did to it."""

    token_id: int
    piece: str
    logit: float
    prob: float  # softmax(logits / T) over the full vocab (T=0: use T=1 for display)
    dropped_by: str | None  # first stage that removed it, None if it survived the chain
    cumulative: float  # descending cumulative probability top_p saw, up to and including it
    final_prob: float  # renormalised probability after the chain (0.0 if dropped)


@dataclass(frozen=True)
class StepTrace:
    """Why one decode step produced the token it did."""

    params: SamplingParams
    candidates: tuple[Candidate, ...]  # top_n by raw logit, best first
    chosen_id: int
    chosen_piece: str
    chosen_logprob: float  # log prob under the raw model distribution (as OpenAI's logprobs)
    sample_logprob: float  # log prob under the distribution sampled from (0.0 for greedy)
    entropy: float  # nats, of the temperature-scaled full distribution (T=0: T=1)
    kept: int  # vocabulary entries that survived the whole chain
    top_p_cut: float | None  # probability mass top_p kept (None when top_p is off)
    forced: bool  # the caller forced this token
    uniform: float | None = None  # the inverse-CDF draw in [0, 1), None when none was made
    vocab_size: int = 0

    @property
    def order(self) -> tuple[str, ...]:
        """The chain's stages in the order this step ran them (the params' order)."""
        return self.params.order
