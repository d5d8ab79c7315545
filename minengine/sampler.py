"""The sampler chain: filter one step's logits stage by stage, draw a token, explain the step.

Each stage reproduces the Hugging Face transformers warper of the same name exactly
(TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, with one
token always kept); only the order in which they run changes between engines (see
`sampling_params`). Greedy (temperature 0) bypasses the chain: the argmax of the raw logits.

Two costs shape the code. Sorting a 49k vocabulary costs ~80 argmaxes on a CPU, so top-p sorts
only its survivors when an earlier stage has cut the vocabulary, and otherwise decides from an
unsorted top-k (see `_top_p_by_estimate`). And `torch.multinomial` draws one exponential per
vocabulary entry, so by default the token is drawn by inverse CDF from a single uniform; the
distribution sampled from is the same, only the mapping from random numbers to tokens differs
(`draw="multinomial"` restores HF's token-for-token behaviour at its price).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from minengine.sampling_params import (
    HF_ORDER,
    LLAMA_CPP_ORDER,
    NAMED_ORDERS,
    SAMPLER_STAGES,
    VLLM_ORDER,
    SamplingParams,
)

__all__ = [
    "HF_ORDER",
    "LLAMA_CPP_ORDER",
    "NAMED_ORDERS",
    "SAMPLER_STAGES",
    "VLLM_ORDER",
    "Candidate",
    "DrawMethod",
    "Sampler",
    "SamplingParams",
    "StepTrace",
    "explain",
    "explain_candidates",
    "filter_logits",
]

DrawMethod = Literal["inverse_cdf", "multinomial"]

_NEG_INF = float("-inf")
_STAGE_CODE = {name: code for code, name in enumerate(SAMPLER_STAGES)}
# Up to this many survivors, top-p sorts just them; beyond, it estimates (see _top_p_by_estimate).
_SMALL_SORT = 2048
# Relative margin by which the unsorted top-p estimate must clear the threshold. HF's float32
# softmax over the sorted row carries a normalisation error (measured up to 6.4e-5 relative
# on 262k random logits, 2.4e-5 on 49k); anything closer is left to the sorted computation.
_TOP_P_MARGIN = 3e-4
# Chunk width for _top_values: a max per chunk is one vectorised pass, unlike torch.topk.
_CHUNK = 32


def _top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) for a long row and small k, in about half the time on a CPU.

    Only the k chunks with the largest maxima can hold the k largest values: if one of them
    lay elsewhere, each of those k chunks would hold a value at least as large. The values
    returned equal torch.topk's; ids may differ among equal values.
    """
    n = x.numel()
    rows = n // _CHUNK
    if k * 4 > rows:
        return torch.topk(x, k)
    best_chunks = torch.topk(x[: rows * _CHUNK].view(rows, _CHUNK).amax(dim=1), k).indices
    ids = (best_chunks.unsqueeze(1) * _CHUNK + torch.arange(_CHUNK, device=x.device)).reshape(-1)
    if rows * _CHUNK < n:
        ids = torch.cat((ids, torch.arange(rows * _CHUNK, n, device=x.device)))
    values, where = torch.topk(x[ids], k)
    return values, ids[where]


# -- the four stages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Live:
    """Scores part-way through the chain: -inf marks a dropped token.

    Once a stage has cut the vocabulary down, `alive` lists exactly the ids still finite, so
    later stages and the draw touch those few entries instead of the whole row. (Masking a
    49k row with masked_fill costs three softmaxes on a CPU; filling it with -inf and copying
    the survivors back costs almost nothing.)
    """

    scores: torch.Tensor
    alive: torch.Tensor | None = None

    def keep_only(self, ids: torch.Tensor) -> _Live:
        scores = torch.full_like(self.scores, _NEG_INF)
        scores[ids] = self.scores[ids]
        return _Live(scores, ids)


def _temperature(live: _Live, t: float) -> _Live:
    if live.alive is None:
        return _Live(live.scores / t)
    scores = torch.full_like(live.scores, _NEG_INF)
    scores[live.alive] = live.scores[live.alive] / t  # the same per-element division as HF
    return _Live(scores, live.alive)


def _top_k(live: _Live, k: int) -> _Live:
    scores, n = live.scores, live.scores.numel()
    if k >= n or (live.alive is not None and live.alive.numel() <= k):
        return live
    best, ids = _top_values(scores, k + 1)
    kth_best = best[k - 1]
    if bool(kth_best == _NEG_INF):  # fewer than k finite scores: nothing to remove
        return live
    if bool(best[k] == kth_best):  # HF removes only scores < the k-th: every tie survives
        return live.keep_only(torch.nonzero(scores >= kth_best).squeeze(1))
    return live.keep_only(ids[:k])


def _min_p(live: _Live, min_p: float) -> _Live:
    probs = torch.softmax(live.scores, dim=-1)  # over the whole row, for HF's exact values
    alive_probs = probs if live.alive is None else probs[live.alive]
    threshold = min_p * alive_probs.amax()
    if not bool(threshold > 0):  # min_p below float32's range removes nothing, as in HF
        return live
    if live.alive is None:
        return live.keep_only(torch.nonzero(probs >= threshold).squeeze(1))
    return live.keep_only(live.alive[alive_probs >= threshold])


def _top_p(live: _Live, top_p: float) -> _Live:
    """HF's rule: sort ascending, drop where the cumulative probability is <= 1 - top_p."""
    threshold = 1 - top_p
    kept = None
    if live.alive is not None and live.alive.numel() <= _SMALL_SORT:
        kept = _top_p_on_survivors(live.scores, live.alive, threshold)
    elif live.scores.numel() > _SMALL_SORT:
        kept = _top_p_by_estimate(live.scores, threshold)
    if kept is None:
        kept = _top_p_sorted(live.scores, threshold)
    return live.keep_only(kept)


def _top_p_sorted(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    # Literally TopPLogitsWarper on one row: the reference every shortcut must agree with.
    ascending, order = torch.sort(scores, descending=False)
    removed_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= threshold
    removed_sorted[-1] = False
    return order[~removed_sorted]


def _top_p_on_survivors(scores: torch.Tensor, alive: torch.Tensor, threshold: float) -> torch.Tensor | None:
    """Exact top-p when only the `alive` ids are finite, sorting just those.

    HF's ascending sort puts every -inf first, so its sorted row equals -inf padding followed
    by the survivors in ascending order; softmax and cumsum over that same row give the same
    bits. Tied scores can sit in either order, which only matters when a tie straddles the
    cut (then torch.sort's order decides, so we defer to it by returning None).
    """
    n, m = scores.numel(), alive.numel()
    ascending, order = torch.sort(scores[alive])
    row = torch.cat((scores.new_full((n - m,), _NEG_INF), ascending)).softmax(dim=-1)
    # The CPU cumsum adds sequentially in double, so the -inf prefix (zeros) can be skipped.
    cumulative = row[n - m :].cumsum(dim=-1) if row.is_cpu else row.cumsum(dim=-1)[n - m :]
    n_removed = min(int(torch.count_nonzero(cumulative <= threshold)), m - 1)
    if n_removed > 0 and bool(ascending[n_removed - 1] == ascending[n_removed]):
        return None
    return alive[order[n_removed:]]


def _top_p_by_estimate(scores: torch.Tensor, threshold: float) -> torch.Tensor | None:
    """Top-p over a large vocabulary without sorting it; the kept ids, or None if unsure.

    HF keeps a token when the probability of it and everything below it exceeds 1 - top_p.
    Taking the best tokens from an unsorted softmax (growing the top-k until the last one is
    surely dropped) gives that quantity in float64 as one minus the mass ranked above. The
    answer is used only when every token clears the threshold by `_TOP_P_MARGIN` (relative)
    and no tie straddles the cut; otherwise None hands the decision back to the sorted
    computation.
    """
    n = scores.numel()
    probs = torch.softmax(scores, dim=-1)
    total = float(probs.sum(dtype=torch.float64))
    margin = _TOP_P_MARGIN * threshold + 1e-9
    width = 256
    while True:
        best_first, ids = _top_values(probs, width)
        mass_above = best_first.cumsum(0, dtype=torch.float64) - best_first
        from_here_down = 1 - mass_above / total  # dividing by total cancels our own rounding
        if float(from_here_down[-1]) < threshold - margin:
            break
        width *= 4
        if width > n // 4:
            return None  # a flat distribution: the full sort is as cheap as more rounds
    if bool(torch.any(torch.abs(from_here_down - threshold) <= margin)):
        return None
    n_kept = max(int(torch.count_nonzero(from_here_down > threshold)), 1)
    if bool(best_first[n_kept - 1] == best_first[n_kept]):
        return None
    return ids[:n_kept]


# -- the chain -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChainRun:
    final: _Live  # after the last stage (temperature applied if it ran)
    cuts: tuple[tuple[str, _Live], ...]  # (stage, what it left) for each stage that cut, in order
    top_p_input: _Live  # what the top_p stage saw, whether or not it was on
    top_p_output: _Live | None  # what it left, None when it was off
    scaled: torch.Tensor | None = None  # the whole row divided by T, when the chain made one


def _as_row(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 1:
        shape = tuple(logits.shape)
        raise ValueError(f"the sampler takes one step's logits as a 1-D tensor; got {shape}")
    return logits if logits.dtype == torch.float32 else logits.float()


def _run_chain(logits: torch.Tensor, params: SamplingParams) -> _ChainRun:
    live = _Live(logits)
    if params.greedy:
        winner = live.keep_only(torch.argmax(logits).reshape(1))
        return _ChainRun(winner, (("temperature", winner),), live, None)

    cuts: list[tuple[str, _Live]] = []
    top_p_input, top_p_output, scaled = live, None, None
    for stage in params.order:
        before = live
        if stage == "temperature":
            if params.temperature != 1:
                live = _temperature(live, params.temperature)
                scaled = live.scores if live.alive is None else None
            continue
        if stage == "top_p":
            top_p_input = live
            if params.top_p < 1:
                live = top_p_output = _top_p(live, params.top_p)
        elif stage == "top_k":
            if params.top_k > 0:
                live = _top_k(live, params.top_k)
        elif params.min_p > 0:
            live = _min_p(live, params.min_p)
        if live is not before:
            cuts.append((stage, live))
    return _ChainRun(live, tuple(cuts), top_p_input, top_p_output, scaled)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the chain without sampling.

    Returns the filtered scores (temperature applied where it ran, -inf for dropped tokens)
    and an int8 tensor giving, per token, the index in SAMPLER_STAGES of the first stage that
    dropped it, or -1 if it survived. At temperature 0 only the argmax survives and every
    other token counts as dropped by temperature. A token whose raw logit is already -inf is
    charged to the first stage that cuts anything.
    """
    run = _run_chain(_as_row(logits), params)
    codes = torch.full(logits.shape, -1, dtype=torch.int8, device=logits.device)
    for stage, live in run.cuts:
        codes.masked_fill_((live.scores == _NEG_INF) & (codes < 0), _STAGE_CODE[stage])
    return run.final.scores, codes


def _final_distribution(live: _Live) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The distribution to draw from: (surviving ids ascending, their probabilities), or
    (None, probabilities over the whole row) when the survivors were never listed."""
    if live.alive is None:
        return None, torch.softmax(live.scores, dim=-1)
    ids = torch.sort(live.alive).values
    return ids, torch.softmax(live.scores[ids], dim=-1)


def _over_row(ids: torch.Tensor | None, probs: torch.Tensor, n: int) -> torch.Tensor:
    if ids is None:
        return probs
    return torch.zeros(n, dtype=probs.dtype, device=probs.device).index_copy_(0, ids, probs)


def _count_alive(live: _Live) -> int:
    if live.alive is not None:
        return live.alive.numel()
    return int(torch.count_nonzero(live.scores > _NEG_INF))


def _logsumexp(live: _Live) -> torch.Tensor:
    return torch.logsumexp(live.scores if live.alive is None else live.scores[live.alive], dim=0)


# -- the trace -----------------------------------------------------------------------------------


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

    order: tuple[str, ...]
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


@dataclass(frozen=True)
class _Display:
    """The temperature-scaled distribution a trace reports (temperature 0 shows T=1)."""

    scaled: torch.Tensor
    probs: torch.Tensor
    log_normaliser: torch.Tensor  # logsumexp(scaled), 0-dim
    entropy: float


def _display(logits: torch.Tensor, params: SamplingParams, run: _ChainRun, peak: int) -> _Display:
    if params.temperature in (0, 1):
        scaled = logits
    elif run.scaled is not None:  # the chain already divided the whole row
        scaled = run.scaled
    else:
        scaled = logits / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    # H = -sum p log p = -log p_peak - sum p (z - z_peak): both terms small, so no cancellation.
    neg_log_peak = -torch.log(probs[peak])
    entropy = float(neg_log_peak - torch.dot(probs, scaled - scaled[peak]))
    if not math.isfinite(entropy):  # a -inf logit: 0 * -inf poisons the dot product
        entropy = float(torch.special.entr(probs).sum())
    return _Display(scaled, probs, scaled[peak] + neg_log_peak, entropy)


def _build_trace(
    logits: torch.Tensor,
    params: SamplingParams,
    run: _ChainRun,
    final_probs: torch.Tensor,
    chosen: int,
    piece: Callable[[int], str],
    top_n: int,
    forced: bool,
    uniform: float | None,
) -> StepTrace:
    best_logits, best_ids = _top_values(logits, min(top_n, logits.numel()))
    # Among equal logits the higher id comes first: the order HF's ascending sort reverses to.
    ranked = sorted(zip(best_ids.tolist(), best_logits.tolist(), strict=True), key=lambda c: (-c[1], -c[0]))
    shown = _display(logits, params, run, peak=ranked[0][0])
    if shown.scaled is logits:
        chosen_logprob = float(logits[chosen] - shown.log_normaliser)
    else:
        chosen_logprob = float(torch.log_softmax(logits, dim=-1)[chosen])
    # Most often top_p saw exactly the displayed row, whose normaliser is already known.
    top_p_lse = shown.log_normaliser if run.top_p_input.scores is shown.scaled else _logsumexp(run.top_p_input)
    top_p_cut = None
    if run.top_p_output is not None:
        top_p_cut = float(torch.exp(_logsumexp(run.top_p_output) - top_p_lse))

    ids = torch.tensor([tid for tid, _ in ranked], dtype=torch.long, device=logits.device)
    # One gather per row and a single transfer: per-candidate tensor ops would dominate.
    prob, top_p_scores, final_prob, *after_cuts = torch.stack(
        [row[ids] for row in (shown.probs, run.top_p_input.scores, final_probs)]
        + [live.scores[ids] for _, live in run.cuts]
    ).tolist()
    top_p_log_normaliser = float(top_p_lse)
    top_p_prob = [math.exp(score - top_p_log_normaliser) for score in top_p_scores]
    stage_scores = [(stage, after) for (stage, _), after in zip(run.cuts, after_cuts, strict=True)]
    candidates, cumulative = [], 0.0
    for i, (tid, logit) in enumerate(ranked):
        cumulative += top_p_prob[i]
        candidates.append(
            Candidate(
                token_id=tid,
                piece=piece(tid),
                logit=logit,
                prob=prob[i],
                dropped_by=next((stage for stage, after in stage_scores if after[i] == _NEG_INF), None),
                cumulative=cumulative,
                final_prob=final_prob[i],
            )
        )

    chosen_final = float(final_probs[chosen])
    sample_logprob = math.log(chosen_final) if chosen_final > 0 else _NEG_INF
    return StepTrace(
        order=params.order,
        params=params,
        candidates=tuple(candidates),
        chosen_id=chosen,
        chosen_piece=piece(chosen),
        chosen_logprob=chosen_logprob,
        sample_logprob=0.0 if params.greedy else sample_logprob,
        entropy=shown.entropy,
        kept=_count_alive(run.final),
        top_p_cut=top_p_cut,
        forced=forced,
        uniform=uniform,
        vocab_size=logits.numel(),
    )


def _explain_row(
    logits: torch.Tensor,
    params: SamplingParams,
    chosen: int,
    piece: Callable[[int], str],
    top_n: int,
    forced: bool,
) -> StepTrace:
    run = _run_chain(logits, params)
    final_probs = _over_row(*_final_distribution(run.final), logits.numel())
    return _build_trace(logits, params, run, final_probs, chosen, piece, top_n, forced, None)


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
    logits = _as_row(logits)
    _check_token(chosen_id, logits.numel())
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
        below = float(torch.nextafter(logits.min(), torch.tensor(_NEG_INF)))
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


# -- sampling ------------------------------------------------------------------------------------


def _check_token(token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")


class Sampler:
    """Draws one token per decode step under SamplingParams, with its own seeded generator.

    `sample` and `sample_traced` run the same chain and consume the generator identically, so
    tracing never changes which token is drawn. Greedy steps draw nothing.
    """

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device | str = "cpu",
        draw: DrawMethod = "inverse_cdf",
    ) -> None:
        params.validate()
        if draw not in ("inverse_cdf", "multinomial"):
            raise ValueError(f"draw must be 'inverse_cdf' or 'multinomial'; got {draw!r}")
        self.params = params
        self.device = torch.device(device)
        self.draw = draw
        # One uniform per step is drawn on the CPU, so a seed gives the same draws on any
        # device; multinomial must draw on the device that holds the probabilities.
        self._generator = torch.Generator(device=self.device if draw == "multinomial" else "cpu")
        self.seed = self._reseed(params.seed)

    def _reseed(self, seed: int | None) -> int:
        seed = secrets.randbits(63) if seed is None else seed
        self._generator.manual_seed(seed)
        return seed

    def update(self, params: SamplingParams) -> None:
        """Use `params` for the next steps; the generator restarts only when given a new seed."""
        params.validate()
        if params.seed is not None and params.seed != self.params.seed:
            self.seed = self._reseed(params.seed)
        self.params = params

    def _draw(self, final: _Live, ids: torch.Tensor | None, probs: torch.Tensor) -> tuple[int, float | None]:
        """One token from the chain's result; returns (token, uniform drawn or None)."""
        if self.draw == "multinomial":  # HF's exact call, on HF's full-row probabilities
            row_probs = torch.softmax(final.scores, dim=-1)
            return int(torch.multinomial(row_probs, 1, generator=self._generator)), None
        u = float(torch.rand((), generator=self._generator, dtype=torch.float64))
        cdf = probs.cumsum(dim=0, dtype=torch.float64)
        total = float(cdf[-1])
        if not math.isfinite(total) or total <= 0:
            raise ValueError("the sampler got logits with no finite maximum (NaN or all -inf)")
        index = int(torch.searchsorted(cdf, u * total, right=True))
        if index == probs.numel():  # u * total rounded up to total: take the last live entry
            index = int(torch.searchsorted(cdf, total))
        return (index if ids is None else int(ids[index])), u

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id (the hot path: no trace is built)."""
        logits = _as_row(logits)
        if self.params.greedy:
            return int(torch.argmax(logits))
        final = _run_chain(logits, self.params).final
        return self._draw(final, *_final_distribution(final))[0]

    def sample_traced(
        self,
        logits: torch.Tensor,
        piece: Callable[[int], str],
        top_n: int = 20,
        force: int | None = None,
    ) -> tuple[int, StepTrace]:
        """The next token id and the trace explaining it.

        With `force`, that token is committed instead, but the generator still advances
        exactly as if a token had been drawn, so later steps draw the same random numbers
        whether or not an earlier one was forced.
        """
        logits = _as_row(logits)
        n = logits.numel()
        if force is not None:
            _check_token(force, n)
        run = _run_chain(logits, self.params)
        ids, probs = _final_distribution(run.final)
        if self.params.greedy:
            chosen, uniform = int(run.final.alive[0]), None
        else:
            chosen, uniform = self._draw(run.final, ids, probs)
        if force is not None:
            chosen = force
        trace = _build_trace(
            logits,
            self.params,
            run,
            _over_row(ids, probs, n),
            chosen,
            piece,
            top_n,
            force is not None,
            uniform,
        )
        return chosen, trace
