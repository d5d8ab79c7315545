"""The decode rows of a shared step attended together, in a few operations per layer.

A decode row's attention alone is a dozen small operations (its K/V copied into its slot, two
narrows, two batched matmuls and a softmax over 3 KV heads and a few dozen keys) whose dispatch
costs far more than their arithmetic: about 100 us a row and layer on 2 cores, most of an
8-row step's attention. When the rows' K/V live in the engine's block pool they can all be
reached by position, so `PooledRows` runs every row of the step at once, per layer:

- one `index_copy_` writes every row's new K (and one its V) into the slot of its position
  (vLLM's slot mapping);
- one `index_select` gathers every row's keys (and one its values) into one padded
  [rows, kv_heads, longest, head_dim], by each table's positions (a table split over several
  runs is read the same way), padding slots pointing at a written position;
- one SDPA with the padding mask attends all rows (`ops.padded_decode_attention`).

A group holds the rows of one pool segment (one tensor per layer to index); a step whose rows
lie in several segments runs a group per segment, and a row whose table crosses segments (a
crowded pool) keeps the per-row path. Gathering from several segments into one padded tensor
would take an `index_copy_` of the whole context, measured ten times slower than the gather.

The gather copies each row's context once per layer, which the per-row path never does: it
pays while the per-row overhead dominates (short contexts) and costs once the copy does (long
ones). `pooled_count` decides per step, by costs measured here, how many of the shortest rows
take this path; the rest keep the per-row one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minengine.fast.attention_rows import RowsKernel
from minengine.kv.block_pool import Segment
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.ops import padded_decode_attention

# Relative costs of one layer's attention, fitted (least squares on the ratios) to both paths'
# times over the default model's shapes, scaled so that a row's fixed cost on the per-row path is
# 90 (about its microseconds on a quiet machine): the pooled path's fixed cost and its cost per
# padded position gathered; the per-row path's cost per row and per position it reads. They put
# the crossover at about 300 positions for 8 rows, 220 for 2. The measurements they were fitted
# to: docs/performance.md, "Pooled decode attention's cost model".
POOLED_FIXED = 60.0
POOLED_PER_POSITION = 0.62
ROW_FIXED = 90.0
ROW_PER_POSITION = 0.35


def pooled_count(lengths: Sequence[int]) -> int:
    """How many of the rows, shortest first, to attend together, given each row's context length:
    the count with the least estimated cost (0 or at least 2)."""
    ordered = sorted(lengths)
    best, best_cost = 0, sum(ROW_FIXED + ROW_PER_POSITION * n for n in ordered)
    rest = best_cost
    for k, n in enumerate(ordered, start=1):
        rest -= ROW_FIXED + ROW_PER_POSITION * n
        cost = POOLED_FIXED + POOLED_PER_POSITION * k * n + rest
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
    """Decode rows over caches in one pool segment, each one new token at `starts[i]`, attended together.

    `tokens[i]` is row i's place among the step's stacked k/v, `queries[i]` among the q its
    layer hands in (the last layer keeps fewer queries than it writes K/V for). `in_place`: the
    C kernel reads the segment where it lies (`serves_store`, the plan's choice), else torch
    gathers the rows' positions into a padded batch.
    """

    def __init__(
        self,
        segment: Segment,
        caches: Sequence[PagedKVCache],
        starts: Sequence[int],
        tokens: Sequence[int],
        queries: Sequence[int],
        scale: float,
        threads: int = 1,
        *,
        in_place: bool,
    ) -> None:
        device = segment.k.device
        self.segment, self.caches, self.scale, self.device = segment, list(caches), scale, device
        self.ends = [s + 1 for s in starts]
        rows, longest = len(self.caches), max(self.ends)
        self.rows, self.longest = rows, longest
        self.tokens = _Take(tokens, device)
        self.queries = _Take(queries, device)
        slots: list[int] = []  # each row's new position in the segment
        table: list[np.ndarray] = []  # each row's positions in the segment, in order
        for cache, end in zip(self.caches, self.ends, strict=True):
            runs = cache.runs(end)
            if any(run.segment is not segment for run in runs):
                raise ValueError("every row's blocks must lie in the segment attended")
            slots.append(runs[-1].local + end - 1 - runs[-1].start)
            spans = [np.arange(run.local, run.local + run.tokens) for run in runs]
            table.append(spans[0] if len(spans) == 1 else np.concatenate(spans))
        # The C kernel reads each row's positions where they lie: no gather, no padding.
        self.kernel = RowsKernel(table, slots, tokens, queries, scale, threads) if in_place else None
        if in_place:
            return
        # Padding reads the row's first position: written, so finite, and masked out.
        padded = [row.tolist() + [int(row[0])] * (longest - end) for row, end in zip(table, self.ends, strict=True)]
        positions = [p for row in padded for p in row]
        self.slots = torch.tensor(slots, device=device)
        self.positions = torch.tensor(positions, device=device)
        self.mask = None
        if min(self.ends) < longest:  # [rows, 1, 1, longest]: True where a row has a key
            ends = torch.tensor(self.ends, device=device)
            self.mask = (torch.arange(longest, device=device) < ends.unsqueeze(1)).view(rows, 1, 1, longest)

    def last_queries_only(self, queries: Sequence[int]) -> None:
        """From now on the rows' queries are at `queries` (the last layer's)."""
        self.queries = _Take(queries, self.device)
        if self.kernel is not None:
            self.kernel.queries(queries)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the rows' k/v [T, kv_heads, d] of `layer` and attend their q [T', heads, d]; [rows, heads*d]."""
        seg_k, seg_v = self.segment.k[layer], self.segment.v[layer]  # [kv_heads, positions, d]
        for cache, end in zip(self.caches, self.ends, strict=True):
            cache.lengths[layer] = end
        if self.kernel is not None:
            return self.kernel(q, k, v, seg_k, seg_v)
        seg_k.index_copy_(1, self.slots, self.tokens(k).transpose(0, 1))
        seg_v.index_copy_(1, self.slots, self.tokens(v).transpose(0, 1))
        heads = seg_k.shape[0]
        keys = seg_k.index_select(1, self.positions).view(heads, self.rows, self.longest, -1).transpose(0, 1)
        values = seg_v.index_select(1, self.positions).view(heads, self.rows, self.longest, -1).transpose(0, 1)
        out = padded_decode_attention(self.queries(q), keys, values, self.mask, self.scale)
        return out.reshape(self.rows, -1)
