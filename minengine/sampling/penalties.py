"""Logit bias and the three penalties, on one step's logit row, as the servers define them.

- `add_logit_bias`: OpenAI's `logit_bias`, added to the named tokens' logits.
- `repetition_penalty`: transformers' `RepetitionPenaltyLogitsProcessor` exactly (gather the
  seen tokens' logits, multiply the negative ones by the penalty and divide the others by it,
  scatter back); "seen" is the prompt and the output so far.
- `frequency_and_presence`: vLLM's `apply_penalties` (model_executor/layers/utils.py), over the
  output tokens only: `logits -= frequency * count`, then `logits -= presence * (count > 0)`.

Each works in place on a row its caller already copied, and touches only the ids it is given:
a request's few hundred seen tokens, not the whole vocabulary (a full-row pass costs as much as a
softmax on a CPU).
"""

from __future__ import annotations

import torch


def add_logit_bias(row: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> None:
    """`row[ids] += bias`, in place (ids unique, as `SamplingParams.logit_bias` holds them)."""
    row.index_add_(0, ids, bias.to(row.dtype))


def repetition_penalty(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor on one row, in place: the logits of the ids
    in `seen` are divided by `penalty` when positive and multiplied by it otherwise."""
    score = row[seen]
    row[seen] = torch.where(score < 0, score * penalty, score / penalty)


def frequency_and_presence(
    row: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float
) -> None:
    """vLLM's additive penalties on one row, in place: `ids` are the distinct output tokens so far
    and `counts` how often each came (float, same device). The frequency term first, then the
    presence term, each as its own subtraction, as vLLM writes them."""
    if frequency != 0:
        row[ids] -= frequency * counts
    if presence != 0:
        row[ids] -= presence * (counts > 0).to(row.dtype)
