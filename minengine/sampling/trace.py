"""Building step traces (`step_trace.StepTrace`) from a step's logits, and re-filtering without the model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minengine.sampling.chain import (
    NEG_INF,
    ChainRun,
    as_row,
    count_alive,
    final_distribution,
    logsumexp,
    over_row,
    run_chain,
    top_values,
)
from minengine.sampling.logit_summary import LogitSummary, display, rank_candidates
from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import Candidate, StepTrace
from minengine.threads import OneThread


@dataclass(frozen=True)
class _Display:
    """The temperature-scaled distribution a trace reports (temperature 0 shows T=1)."""

    scaled: torch.Tensor
    probs: torch.Tensor
    log_normaliser: torch.Tensor  # logsumexp(scaled), 0-dim
    entropy: float


def _display(logits: torch.Tensor, params: SamplingParams, chain_scaled: torch.Tensor | None, peak: int) -> _Display:
    if params.temperature in (0, 1):
        scaled = logits
    elif chain_scaled is not None:  # the chain already divided the whole row
        scaled = chain_scaled
    else:
        scaled = logits / params.temperature
    shown = display(scaled, peak)
    return _Display(scaled, shown.probs, shown.log_normaliser, shown.entropy)


def _candidates(
    ranked: list[tuple[int, float]],
    piece: Callable[[int], str],
    prob: list[float],
    top_p_prob: list[float],
    dropped_by: list[str | None],
    final_prob: list[float],
) -> tuple[Candidate, ...]:
    """The candidates in display order; `cumulative` adds top_p's probabilities down the ranking."""
    out, cumulative = [], 0.0
    for i, (tid, logit) in enumerate(ranked):
        cumulative += top_p_prob[i]
        out.append(Candidate(tid, piece(tid), logit, prob[i], dropped_by[i], cumulative, final_prob[i]))
    return tuple(out)


def build_trace(
    logits: torch.Tensor,
    params: SamplingParams,
    run: ChainRun,
    final_probs: torch.Tensor,
    chosen: int,
    piece: Callable[[int], str],
    top_n: int,
    forced: bool,
    uniform: float | None,
) -> StepTrace:
    """The trace of one step: the top candidates and what the chain did to each.

    Callers run it on one thread (`OneThread`, as `Sampler.sample_traced` and `explain` do): its
    dozen passes over a vocabulary row are each too short to pay for waking a second one
    (measured 1.9 ms a step on two threads, 1.3 ms on one), and every trace, drawn or explained
    later, then sums in the same order.
    """
    best_logits, best_ids = top_values(logits, min(top_n, logits.numel()))
    ranked = rank_candidates(best_ids, best_logits)
    shown = _display(logits, params, run.scaled, peak=ranked[0][0])
    if shown.scaled is logits:
        chosen_logprob = float(logits[chosen] - shown.log_normaliser)
    else:
        chosen_logprob = float(torch.log_softmax(logits, dim=-1)[chosen])
    # Most often top_p saw exactly the displayed row, whose normaliser is already known.
    top_p_lse = shown.log_normaliser if run.top_p_input.scores is shown.scaled else logsumexp(run.top_p_input)
    top_p_cut = None
    if run.top_p_output is not None:
        top_p_cut = float(torch.exp(logsumexp(run.top_p_output) - top_p_lse))

    ids = torch.tensor([tid for tid, _ in ranked], dtype=torch.long, device=logits.device)
    # One gather per row and a single transfer: per-candidate tensor ops would dominate.
    prob, top_p_scores, final_prob, *after_cuts = torch.stack(
        [row[ids] for row in (shown.probs, run.top_p_input.scores, final_probs)]
        + [live.scores[ids] for _, live in run.cuts]
    ).tolist()
    top_p_log_normaliser = float(top_p_lse)
    top_p_prob = [math.exp(score - top_p_log_normaliser) for score in top_p_scores]
    stage_scores = [(stage, after) for (stage, _), after in zip(run.cuts, after_cuts, strict=True)]
    dropped_by = [next((stage for stage, after in stage_scores if after[i] == NEG_INF), None) for i in range(len(prob))]
    candidates = _candidates(ranked, piece, prob, top_p_prob, dropped_by, final_prob)

    chosen_final = float(final_probs[chosen])
    sample_logprob = math.log(chosen_final) if chosen_final > 0 else NEG_INF
    return StepTrace(
        params=params,
        candidates=candidates,
        chosen_id=chosen,
        chosen_piece=piece(chosen),
        chosen_logprob=chosen_logprob,
        sample_logprob=0.0 if params.greedy else sample_logprob,
        entropy=shown.entropy,
        kept=count_alive(run.final),
        top_p_cut=top_p_cut,
        forced=forced,
        uniform=uniform,
        vocab_size=logits.numel(),
    )


def greedy_candidates(top_n: int) -> int:
    """How many top candidates `greedy_trace` searches for a trace showing `top_n` (at least 2, to
    tell a tie at the top; a row shorter than that gives all it has)."""
    return max(top_n, 2)


def greedy_trace(
    logits: torch.Tensor,
    params: SamplingParams,
    chosen: int | None,
    piece: Callable[[int], str],
    top_n: int,
    forced: bool,
    summary: LogitSummary | None = None,
) -> StepTrace | None:
    """`build_trace` for a greedy step, from the top candidates alone; None when it cannot tell.

    At temperature 0 the chain keeps only the argmax, so everything the general path gets from
    full-row intermediates (the -inf row, the one-hot final distribution, a separate argmax)
    is known from the top candidates: the winner is the lowest id holding the top logit, found
    among them whenever the last candidate is strictly below it. That drops about ten
    operations on a 49k row from each traced step, each one paying cold caches right after a
    decode step has streamed the weights (~0.6 ms a step). Values are bit for bit the general
    path's (same display softmax, same gathers); a non-finite top logit, or ties reaching past
    the candidates, return None and the caller takes the general path. `chosen` None means
    the argmax; otherwise it is the committed token (forced, or given to `explain`). A `summary`
    of these very logits (`logit_summary`, made in the step for every row that shares it)
    stands in for the top candidates and the display softmax, with the same values.
    """
    n = logits.numel()
    k = min(greedy_candidates(top_n), n)
    if summary is not None and (summary.logits is not logits or summary.k != k):
        summary = None
    best_logits, best_ids = (summary.top_logits, summary.top_ids) if summary is not None else top_values(logits, k)
    ranked = rank_candidates(best_ids, best_logits)
    top = ranked[0][1]
    if not math.isfinite(top) or (k < n and ranked[-1][1] == top):
        return None
    winner = min(tid for tid, logit in ranked if logit == top)  # torch.argmax: the first maximum
    ranked = ranked[: min(top_n, n)]
    chosen = winner if chosen is None else chosen
    shown = summary.display if summary is not None and summary.display is not None else None
    if shown is None:
        shown = _display(logits, params, None, peak=ranked[0][0])
    ids = torch.tensor([tid for tid, _ in ranked], dtype=torch.long, device=logits.device)
    log_normaliser = float(shown.log_normaliser)
    top_p_prob = [math.exp(logit - log_normaliser) for _, logit in ranked]
    kept = [tid == winner for tid, _ in ranked]
    candidates = _candidates(
        ranked,
        piece,
        shown.probs[ids].tolist(),
        top_p_prob,
        [None if k else "temperature" for k in kept],
        [1.0 if k else 0.0 for k in kept],
    )
    return StepTrace(
        params=params,
        candidates=candidates,
        chosen_id=chosen,
        chosen_piece=piece(chosen),
        chosen_logprob=float(logits[chosen] - shown.log_normaliser),
        sample_logprob=0.0,
        entropy=shown.entropy,
        kept=1,
        top_p_cut=None,
        forced=forced,
        uniform=None,
        vocab_size=n,
    )


def _explain_row(
    logits: torch.Tensor,
    params: SamplingParams,
    chosen: int,
    piece: Callable[[int], str],
    top_n: int,
    forced: bool,
) -> StepTrace:
    with OneThread(logits.device):
        if params.greedy:
            trace = greedy_trace(logits, params, chosen, piece, top_n, forced)
            if trace is not None:
                return trace
        run = run_chain(logits, params)
        final_probs = over_row(*final_distribution(run.final), logits.numel())
        return build_trace(logits, params, run, final_probs, chosen, piece, top_n, forced, None)


def explain(
    logits: torch.Tensor,
    params: SamplingParams,
    chosen_id: int,
    piece: Callable[[int], str],
    top_n: int = 20,
    forced: bool = False,
) -> StepTrace:
    """Trace the chain under `params` for logits already computed (no model run, no draw)."""
    params.validate()
    logits = as_row(logits)
    check_token(chosen_id, logits.numel())
    return _explain_row(logits, params, chosen_id, piece, top_n, forced)


def explain_candidates(
    candidates: Sequence[Candidate],
    params: SamplingParams,
    chosen_id: int,
    *,
    recorded_temperature: float = 1.0,
    vocab_size: int = 0,
    chosen_piece: str = "",
    forced: bool = False,
) -> StepTrace:
    """Approximate `explain` from a recorded trace's candidates alone (replay without a model).

    The recorded tokens keep their exact logits. The rest of the vocabulary is unknown except
    for the probability it held together: 1 - sum(prob) at the recorded temperature. It is
    rebuilt as `vocab_size - len(candidates)` tokens sharing that mass equally (with no
    vocab_size, as few tokens as can hold it, each no likelier than the last candidate), placed
    just below the lowest recorded logit. The chain then runs unchanged on that vector. Exact
    for the recorded tokens' ranks, top_k <= len(candidates) and min_p; top_p, entropy and
    probabilities are exact at the recorded temperature and approximate at others, since the
    real unseen logits spread out differently when rescaled. A chosen token that was not
    recorded is treated as one of the unseen tokens.
    """
    if not candidates:
        raise ValueError("explain_candidates needs at least one recorded candidate")
    params.validate()
    recorded_t = recorded_temperature or 1.0
    # float64: thousands of equal tiny tail entries would bias a float32 softmax sum.
    logits = torch.tensor([c.logit for c in candidates], dtype=torch.float64)
    probs = [c.prob for c in candidates]
    unseen_mass = max(0.0, 1.0 - math.fsum(probs))
    top = max(range(len(candidates)), key=probs.__getitem__)
    log_normaliser = candidates[top].logit / recorded_t - math.log(probs[top])
    if vocab_size:
        n_unseen = max(vocab_size - len(candidates), 0)
    else:
        n_unseen = math.ceil(unseen_mass / min(probs)) if unseen_mass > 0 and min(probs) > 0 else 0
    if unseen_mass > 0 and n_unseen > 0:
        share = recorded_t * (math.log(unseen_mass / n_unseen) + log_normaliser)
        below = float(torch.nextafter(logits.min(), torch.tensor(NEG_INF)))
        tail = torch.full((n_unseen,), min(share, below), dtype=torch.float64)
        logits = torch.cat((logits, tail))
    else:
        n_unseen = 0

    local = {c.token_id: i for i, c in enumerate(candidates)}
    if chosen_id in local:
        chosen_local = local[chosen_id]
        chosen_piece = chosen_piece or candidates[chosen_local].piece
    elif n_unseen:
        chosen_local = len(candidates)
    else:
        raise ValueError(f"token {chosen_id} is not among the recorded candidates and no unseen mass is left")

    def local_piece(i: int) -> str:
        return candidates[i].piece if i < len(candidates) else chosen_piece

    trace = _explain_row(logits, params, chosen_local, local_piece, len(candidates), forced)
    remapped = tuple(dataclasses.replace(c, token_id=candidates[c.token_id].token_id) for c in trace.candidates)
    return dataclasses.replace(
        trace,
        candidates=remapped,
        chosen_id=chosen_id,
        vocab_size=vocab_size or trace.vocab_size,
    )


def check_token(token_id: int, vocab_size: int) -> None:
    """Refuse a token id outside the vocabulary."""
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
