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
class RemovedToken:
    """A likely token a stage before the filters took away."""

    token_id: int
    piece: str
    prob: float  # its probability before the stage (softmax of the raw logits)


@dataclass(frozen=True)
class GrammarFacts:
    """What the grammar's mask did to one step."""

    allowed: int  # vocabulary entries the grammar allowed
    vocab_size: int
    removed: tuple[RemovedToken, ...]  # the most likely tokens it forbade, most likely first
    mass_removed: float  # raw probability mass on the forbidden tokens
    state: str  # where the grammar is, in a few words ("inside a string", "done: only end of turn")


@dataclass(frozen=True)
class RankChange:
    """A token whose rank the bias or penalties moved."""

    token_id: int
    piece: str
    rank_before: int  # 1 = most likely, by raw logit
    rank_after: int  # after bias and penalties
    logit_before: float
    logit_after: float


@dataclass(frozen=True)
class Adjustments:
    """What the stages before the filters (grammar, min_tokens, bias, penalties) did to one step."""

    grammar: GrammarFacts | None = None
    min_tokens_masked: int = 0  # end tokens masked because min_tokens were not yet out
    changes: tuple[RankChange, ...] = ()  # tokens whose rank bias or penalties moved, best after first
    winner_before: int | None = None  # the raw argmax, when the stages changed the argmax
    winner_after: int | None = None


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
    adjustments: Adjustments | None = None  # None when no stage before the filters was on

    @property
    def order(self) -> tuple[str, ...]:
        """The chain's stages in the order this step ran them (the params' order)."""
        return self.params.order
