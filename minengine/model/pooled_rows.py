"""The decode rows of a shared step attended together, in a few operations per layer.

A decode row's attention alone is a dozen small operations (its K/V copied into its slot, two
narrows, two batched matmuls and a softmax over 3 KV heads and a few dozen keys) whose dispatch
costs far more than their arithmetic: about 100 us a row and layer on 2 cores, most of an
8-row step's attention. When the rows' K/V live in the engine's block pool they can all be
reached by position, so `PooledRows` runs every row of the step at once, per layer:

- one `index_copy_` per segment writes every row's new K (and one its V) into the slot of its
  position (vLLM's slot mapping);
- one `index_select` gathers every row's keys (and one its values) into one padded
  [rows, kv_heads, longest, head_dim], by each table's positions (a table split over several
  runs or segments is read the same way), padding slots pointing at a written position;
- one SDPA with the padding mask attends all rows (`ops.padded_decode_attention`).

The gather copies each row's context once per layer, which the per-row path never does: it
pays while the per-row overhead dominates (short contexts) and costs once the copy does (long
ones). `pooled_count` decides per step, by costs measured here, how many of the shortest rows
take this path; the rest keep the per-row one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minengine.kv.block_pool import Segment
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.ops import padded_decode_attention

# Costs measured on the default model, 2 cores, float32 (scripts/batch_step_cost; the per-row
# path against the pooled one, 1 to 8 rows at contexts 60, 500 and 2,000), in microseconds per
# layer: the pooled path's fixed cost, and per position of the padded gather; the per-row path's
# cost per row, and per position it reads.
POOLED_FIXED_US = 60.0
POOLED_PER_POSITION_US = 0.05
ROW_FIXED_US = 90.0
ROW_PER_POSITION_US = 0.02


def pooled_count(lengths: Sequence[int]) -> int:
    """How many of the rows, shortest first, to attend together, given each row's context length:
    the count with the least estimated cost (0 or at least 2)."""
    ordered = sorted(lengths)
    best, best_cost = 0, sum(ROW_FIXED_US + ROW_PER_POSITION_US * n for n in ordered)
    rest = best_cost
    for k, n in enumerate(ordered, start=1):
        rest -= ROW_FIXED_US + ROW_PER_POSITION_US * n
        cost = POOLED_FIXED_US + POOLED_PER_POSITION_US * k * n + rest
        if k >= 2 and cost < best_cost:
            best, best_cost = k, cost
    return best


class _Take:
    """Rows `at` of a tensor: a narrow when they are consecutive, else one `index_select`."""

    __slots__ = ("first", "count", "index")

    def __init__(self, at: Sequence[int], device: torch.device) -> None:
        self.first, self.count = at[0], len(at)
        consecutive = list(at) == list(range(self.first, self.first + self.count))
        self.index = None if consecutive else torch.tensor(at, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return x if self.count == x.shape[0] else x.narrow(0, self.first, self.count)
        return x.index_select(0, self.index)


class PooledRows:
    """Decode rows over caches in one block store, each one new token at `starts[i]`, attended together.

    `tokens[i]` is row i's place among the step's stacked k/v, `queries[i]` among the q its
    layer hands in (the last layer keeps fewer queries than it writes K/V for).
    """

    def __init__(
        self,
        caches: Sequence[PagedKVCache],
        starts: Sequence[int],
        tokens: Sequence[int],
        queries: Sequence[int],
        scale: float,
        device: torch.device,
    ) -> None:
        self.caches, self.scale, self.device = list(caches), scale, device
        self.ends = [s + 1 for s in starts]
        rows, longest = len(self.caches), max(self.ends)
        self.rows, self.longest = rows, longest
        self.tokens = _Take(tokens, device)
        self.queries = _Take(queries, device)
        writes: dict[Segment, tuple[list[int], list[int]]] = {}  # segment -> (slots, rows)
        reads: dict[Segment, tuple[list[int], list[int]]] = {}  # segment -> (positions there, padded slots)
        for r, (cache, end) in enumerate(zip(self.caches, self.ends, strict=True)):
            runs = cache.runs(end)
            last = runs[-1]
            slots, which = writes.setdefault(last.segment, ([], []))
            slots.append(last.local + end - 1 - last.start)
            which.append(r)
            for run in runs:
                src, dst = reads.setdefault(run.segment, ([], []))
                src.extend(range(run.local, run.local + run.tokens))
                dst.extend(range(r * longest + run.start, r * longest + run.start + run.tokens))
            if end < longest:  # padding reads the row's first position: written, so finite, and masked out
                first = runs[0]
                src, dst = reads.setdefault(first.segment, ([], []))
                src.extend([first.local] * (longest - end))
                dst.extend(range(r * longest + end, (r + 1) * longest))
        self.writes = [
            (seg, torch.tensor(slots, device=device), _Take(which, device)) for seg, (slots, which) in writes.items()
        ]
        # From one segment, the positions are listed in slot order (rows in order, each row's runs
        # in order, then its padding): one gather lays them out. From several, each segment's
        # part is copied into its slots.
        one = len(reads) == 1
        self.reads = [
            (seg, torch.tensor(src, device=device), None if one else torch.tensor(dst, device=device))
            for seg, (src, dst) in reads.items()
        ]
        self.mask = None
        if min(self.ends) < longest:  # [rows, 1, 1, longest]: True where a row has a key
            ends = torch.tensor(self.ends, device=device)
            self.mask = (torch.arange(longest, device=device) < ends.unsqueeze(1)).view(rows, 1, 1, longest)

    def last_queries_only(self, queries: Sequence[int]) -> None:
        """From now on the rows' queries are at `queries` (the last layer's)."""
        self.queries = _Take(queries, self.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the rows' k/v [T, kv_heads, d] of `layer` and attend their q [T', heads, d]; [rows, heads*d]."""
        k, v = self.tokens(k), self.tokens(v)  # [rows, kv_heads, d]
        for seg, slots, which in self.writes:
            seg.k[layer].index_copy_(1, slots, which(k).transpose(0, 1))
            seg.v[layer].index_copy_(1, slots, which(v).transpose(0, 1))
        for cache, end in zip(self.caches, self.ends, strict=True):
            cache.lengths[layer] = end
        keys, values = self._gather(layer, 0), self._gather(layer, 1)
        heads = keys.shape[0]
        keys = keys.view(heads, self.rows, self.longest, -1).transpose(0, 1)
        values = values.view(heads, self.rows, self.longest, -1).transpose(0, 1)
        out = padded_decode_attention(self.queries(q), keys, values, self.mask, self.scale)
        return out.reshape(self.rows, -1)

    def _gather(self, layer: int, which: int) -> torch.Tensor:
        """Every row's K (which=0) or V (1) of `layer`, padded: [kv_heads, rows*longest, d]."""
        if len(self.reads) == 1:
            seg, src, _ = self.reads[0]
            return (seg.k if which == 0 else seg.v)[layer].index_select(1, src)
        out = None
        for seg, src, dst in self.reads:
            t = (seg.k if which == 0 else seg.v)[layer]
            if out is None:
                out = t.new_empty(t.shape[0], self.rows * self.longest, t.shape[2])
            out.index_copy_(1, dst, t.index_select(1, src))
        assert out is not None
        return out

