"""The filter stages of the sampler chain: temperature, top-k, top-p, min-p.

Each stage reproduces the Hugging Face transformers warper of the same name exactly
(TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, with one
token always kept); only the order in which they run changes between engines (see
`sampling.params`).

Sorting a 49k vocabulary costs ~80 argmaxes on a CPU, so top-p sorts only its survivors when an
earlier stage has cut the vocabulary, and otherwise decides from an unsorted top-k (see
`_top_p_by_estimate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minengine.sampling.params import SAMPLER_STAGES, SamplingParams

NEG_INF = float("-inf")
STAGE_CODE = {name: code for code, name in enumerate(SAMPLER_STAGES)}
# Up to this many survivors, top-p sorts just them; beyond, it estimates (see _top_p_by_estimate).
_SMALL_SORT = 2048
# Relative margin by which the unsorted top-p estimate must clear the threshold. HF's float32
# softmax over the sorted row carries a normalisation error (measured up to 6.4e-5 relative
# on 262k random logits, 2.4e-5 on 49k); anything closer is left to the sorted computation.
_TOP_P_MARGIN = 3e-4
# Chunk width for top_values: a max per chunk is one vectorised pass, unlike torch.topk.
TOP_VALUES_CHUNK = 32


def top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) for a long row and small k, in about half the time on a CPU.

    Only the k chunks with the largest maxima can hold the k largest values: if one of them
    lay elsewhere, each of those k chunks would hold a value at least as large. The values
    returned equal torch.topk's; ids may differ among equal values.
    """
    n = x.numel()
    rows = n // TOP_VALUES_CHUNK
    if k * 4 > rows:
        return torch.topk(x, k)
    best_chunks = torch.topk(x[: rows * TOP_VALUES_CHUNK].view(rows, TOP_VALUES_CHUNK).amax(dim=1), k).indices
    ids = _chunk_members(best_chunks, n)
    values, where = torch.topk(x[ids], k)
    return values, ids[where]


def top_values_rows(stacked: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`top_values` of every row of [rows, n], the chunk maxima and their top-k in one pass each
    (row-wise, so each row gets the bits it gets alone)."""
    count, n = stacked.shape
    chunks = n // TOP_VALUES_CHUNK
    if k * 4 > chunks:
        return [top_values(row, k) for row in stacked]
    maxima = stacked[:, : chunks * TOP_VALUES_CHUNK].view(count, chunks, TOP_VALUES_CHUNK).amax(dim=2)
    ids = _chunk_members(torch.topk(maxima, k, dim=1).indices, n)
    out = []
    for row, row_ids in zip(stacked, ids, strict=True):
        values, where = torch.topk(row[row_ids], k)
        out.append((values, row_ids[where]))
    return out


def _chunk_members(best_chunks: torch.Tensor, n: int) -> torch.Tensor:
    """The ids in chunks `best_chunks` [..., k] of a row of n, then the tail past the last whole chunk."""
    device = best_chunks.device
    ids = (best_chunks.unsqueeze(-1) * TOP_VALUES_CHUNK + torch.arange(TOP_VALUES_CHUNK, device=device)).flatten(-2)
    whole = n // TOP_VALUES_CHUNK * TOP_VALUES_CHUNK
    if whole < n:
        ids = torch.cat((ids, torch.arange(whole, n, device=device).expand(*ids.shape[:-1], -1)), dim=-1)
    return ids


# -- the four stages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Live:
    """Scores part-way through the chain: -inf marks a dropped token.

    Once a stage has cut the vocabulary down, `alive` lists exactly the ids still finite, so
    later stages and the draw touch those few entries instead of the whole row. (Masking a
    49k row with masked_fill costs three softmaxes on a CPU; filling it with -inf and copying
    the survivors back costs almost nothing.)
    """

    scores: torch.Tensor
    alive: torch.Tensor | None = None

    def keep_only(self, ids: torch.Tensor) -> Live:
        scores = torch.full_like(self.scores, NEG_INF)
        scores[ids] = self.scores[ids]
        return Live(scores, ids)


def _temperature(live: Live, t: float) -> Live:
    if live.alive is None:
        return Live(live.scores / t)
    scores = torch.full_like(live.scores, NEG_INF)
    scores[live.alive] = live.scores[live.alive] / t  # the same per-element division as HF
    return Live(scores, live.alive)


def _top_k(live: Live, k: int) -> Live:
    scores, n = live.scores, live.scores.numel()
    if k >= n or (live.alive is not None and live.alive.numel() <= k):
        return live
    best, ids = top_values(scores, k + 1)
    kth_best = best[k - 1]
    if bool(kth_best == NEG_INF):  # fewer than k finite scores: nothing to remove
        return live
    if bool(best[k] == kth_best):  # HF removes only scores < the k-th: every tie survives
        return live.keep_only(torch.nonzero(scores >= kth_best).squeeze(1))
    return live.keep_only(ids[:k])


def _min_p(live: Live, min_p: float) -> Live:
    probs = torch.softmax(live.scores, dim=-1)  # over the whole row, for HF's exact values
    alive_probs = probs if live.alive is None else probs[live.alive]
    threshold = min_p * alive_probs.amax()
    if not bool(threshold > 0):  # min_p below float32's range removes nothing, as in HF
        return live
    if live.alive is None:
        return live.keep_only(torch.nonzero(probs >= threshold).squeeze(1))
    return live.keep_only(live.alive[alive_probs >= threshold])


def _top_p(live: Live, top_p: float) -> Live:
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
    row = torch.cat((scores.new_full((n - m,), NEG_INF), ascending)).softmax(dim=-1)
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
        best_first, ids = top_values(probs, width)
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
class ChainRun:
    """What each stage of one pass through the chain left alive."""

    final: Live  # after the last stage (temperature applied if it ran)
    cuts: tuple[tuple[str, Live], ...]  # (stage, what it left) for each stage that cut, in order
    top_p_input: Live  # what the top_p stage saw, whether or not it was on
    top_p_output: Live | None  # what it left, None when it was off
    scaled: torch.Tensor | None = None  # the whole row divided by T, when the chain made one


def as_row(logits: torch.Tensor) -> torch.Tensor:
    """One step's logits as a float32 row; anything but 1-D is refused."""
    if logits.dim() != 1:
        shape = tuple(logits.shape)
        raise ValueError(f"the sampler takes one step's logits as a 1-D tensor; got {shape}")
    return logits if logits.dtype == torch.float32 else logits.float()


def run_chain(logits: torch.Tensor, params: SamplingParams) -> ChainRun:
    """Apply the stages in `params.order`, recording what each one cut."""
    live = Live(logits)
    if params.greedy:
        winner = live.keep_only(torch.argmax(logits).reshape(1))
        return ChainRun(winner, (("temperature", winner),), live, None)

    cuts: list[tuple[str, Live]] = []
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
    return ChainRun(live, tuple(cuts), top_p_input, top_p_output, scaled)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the chain without sampling.

    Returns the filtered scores (temperature applied where it ran, -inf for dropped tokens)
    and an int8 tensor giving, per token, the index in SAMPLER_STAGES of the first stage that
    dropped it, or -1 if it survived. At temperature 0 only the argmax survives and every
    other token counts as dropped by temperature. A token whose raw logit is already -inf is
    charged to the first stage that cuts anything.
    """
    run = run_chain(as_row(logits), params)
    codes = torch.full(logits.shape, -1, dtype=torch.int8, device=logits.device)
    for stage, live in run.cuts:
        codes.masked_fill_((live.scores == NEG_INF) & (codes < 0), STAGE_CODE[stage])
    return run.final.scores, codes


def final_distribution(live: Live) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The distribution to draw from: (surviving ids ascending, their probabilities), or
    (None, probabilities over the whole row) when the survivors were never listed."""
    if live.alive is None:
        return None, torch.softmax(live.scores, dim=-1)
    ids = torch.sort(live.alive).values
    return ids, torch.softmax(live.scores[ids], dim=-1)


def over_row(ids: torch.Tensor | None, probs: torch.Tensor, n: int) -> torch.Tensor:
    """Survivors' probabilities scattered back over the full vocabulary row."""
    if ids is None:
        return probs
    return torch.zeros(n, dtype=probs.dtype, device=probs.device).index_copy_(0, ids, probs)


def count_alive(live: Live) -> int:
    """How many vocabulary entries are still alive."""
    if live.alive is not None:
        return live.alive.numel()
    return int(torch.count_nonzero(live.scores > NEG_INF))


def logsumexp(live: Live) -> torch.Tensor:
    """log-sum-exp over the surviving scores (the survivors' normaliser)."""
    return torch.logsumexp(live.scores if live.alive is None else live.scores[live.alive], dim=0)
