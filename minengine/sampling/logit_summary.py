"""What a greedy step's trace reads from its logits, computed for every row of a shared step at once.

A traced greedy step needs, from a 49k-logit row, its top candidates and the displayed
distribution (softmax at temperature 1: the normaliser, the candidates' probabilities and the
entropy). Computed by each request on its own thread after the step, that is a dozen passes over
a row whose caches the step has just evicted, plus their dispatch: about 1 ms a request. Eight
requests sharing a step pay it one after another (two cores, one interpreter lock) while the
step waits for their next tokens; measured, that wait was 8 ms of a 64 ms period at 8 streams.

So the step loop computes it once for all the rows that ask (`summarize`): one stacked top-k
search and one softmax over [rows, vocab], then the few per-row scalars. The values are the ones
`trace.greedy_trace` would compute for the row alone, bit for bit (row-wise softmax, amax and
topk give each row the bits they give it alone; the per-row dot product runs on one thread, as a
request's own sampling does), so a request's trace does not depend on what shared its step.
`greedy_trace` takes a summary only for the exact tensor it was made from (`LogitSummary.logits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minengine.sampling.chain import top_values_rows
from minengine.threads import OneThread


@dataclass(frozen=True)
class Display:
    """The temperature-1 distribution a greedy trace reports."""

    probs: torch.Tensor  # softmax of the row
    log_normaliser: torch.Tensor  # logsumexp of the row, 0-dim
    entropy: float


@dataclass(frozen=True)
class LogitSummary:
    """One logits row's top `k` candidates and its displayed distribution."""

    logits: torch.Tensor  # the row summarized: readers check they hold this very tensor
    k: int
    top_logits: torch.Tensor  # [k], as `chain.top_values(logits, k)`
    top_ids: torch.Tensor  # [k]
    display: Display | None  # None where the row's top logit is not finite


def rank_candidates(ids: torch.Tensor, values: torch.Tensor) -> list[tuple[int, float]]:
    """Candidates by descending logit; among equal logits the higher id first (the order HF's
    ascending sort reverses to)."""
    return sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda c: (-c[1], -c[0]))


def display(
    logits: torch.Tensor, peak: int, probs: torch.Tensor | None = None, diff: torch.Tensor | None = None
) -> Display:
    """The temperature-1 distribution of one row, from its softmax `probs` and its `diff` (logits
    minus the peak's) when already made."""
    probs = torch.softmax(logits, dim=-1) if probs is None else probs
    diff = logits - logits[peak] if diff is None else diff
    # H = -sum p log p = -log p_peak - sum p (z - z_peak): both terms small, so no cancellation.
    neg_log_peak = -torch.log(probs[peak])
    entropy = float(neg_log_peak - torch.dot(probs, diff))
    if not math.isfinite(entropy):  # a -inf logit: 0 * -inf poisons the dot product
        entropy = float(torch.special.entr(probs).sum())
    return Display(probs, logits[peak] + neg_log_peak, entropy)


def summarize(rows: Sequence[torch.Tensor], k: int) -> list[LogitSummary]:
    """Each float32 row's summary with its top `k` candidates; the heavy passes run once over all rows."""
    if not rows:
        return []
    stacked = _stacked(rows)  # [rows, vocab]
    width = stacked.shape[1]
    k = min(k, width)
    tops = top_values_rows(stacked, k)
    peaks = [rank_candidates(ids, values)[0][0] for values, ids in tops]
    probs = torch.softmax(stacked, dim=-1)
    # Subtraction is exact, so one stacked pass gives each row the bits its own gives.
    diffs = stacked - stacked.gather(1, torch.tensor(peaks, device=stacked.device).unsqueeze(1))
    out = []
    with OneThread(stacked.device):  # the per-row sums in a request's own order (one thread)
        for i, row in enumerate(rows):
            values, ids = tops[i]
            row_probs, diff = probs[i], diffs[i]
            if row_probs.data_ptr() % 64:  # a dot product sums by its operands' alignment; a row's own are aligned
                row_probs, diff = row_probs.clone(), diff.clone()
            shown = display(row, peaks[i], row_probs, diff) if torch.isfinite(values[0]) else None
            out.append(LogitSummary(row, k, values, ids, shown))
    return out


def _stacked(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows as one [rows, vocab] tensor: a view when they lie end to end (a step's logits, every
    row asking), else a copy. (A fresh 1.5 MiB tensor here costs its page faults: ~0.5 ms.)"""
    first, width = rows[0], rows[0].numel()
    step = width * first.element_size()
    if all(r.is_contiguous() and r.dim() == 1 and r.numel() == width for r in rows) and all(
        r.data_ptr() == first.data_ptr() + i * step for i, r in enumerate(rows)
    ):
        return first.as_strided((len(rows), width), (width, 1))
    return torch.stack(list(rows))
