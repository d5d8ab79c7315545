"""The log probabilities a response reports, read from the engine's logits.

They are the raw model distribution, log-softmax of the logits before temperature and the
sampler's filters, which is what OpenAI and vLLM report by default. (A sampler trace is no
substitute: its candidate probabilities are temperature-scaled, and a sampled token can lie
outside its candidates.) The logits are read at the pause before each token, where the
session holds them in `pending_logits`, so a request that asks for logprobs pays one
log-softmax and one top-k per step and one that does not pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reqscope.openai.logprobs import TokenLogprob, TopLogprob


class LogprobProbe:
    """Capture a step's logits, then describe the token the step chose."""

    def __init__(self, top: int, piece: Callable[[int], str]) -> None:
        self.top = top
        self.piece = piece
        self._log_probs: torch.Tensor | None = None

    def capture(self, logits: torch.Tensor | None) -> None:
        """Remember the log probabilities of the step about to be sampled."""
        self._log_probs = None if logits is None else torch.log_softmax(logits.float(), dim=-1)

    def entry(self, token_id: int) -> TokenLogprob | None:
        """The chosen token, its log probability and the `top` likeliest tokens of its step."""
        log_probs, self._log_probs = self._log_probs, None
        if log_probs is None:
            return None
        alternatives: tuple[TopLogprob, ...] = ()
        if self.top > 0:
            values, ids = torch.topk(log_probs, min(self.top, log_probs.numel()))
            alternatives = tuple(
                TopLogprob(self.piece(i), v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            )
        return TokenLogprob(self.piece(token_id), float(log_probs[token_id]), alternatives)
