"""Attention over a shared step's rows: the stacked q/k/v cut back into sequences, each over its own cache."""

from __future__ import annotations

import torch

from minengine.fast.chunk_attention import PagedChunk, attend_chunk_rounded
from minengine.fast.pooled_rows import PooledRows
from minengine.model.ops import heads_first
from minengine.model.transformer import Transformer
from minengine.steps.rows import PoolGroup, Row
from minengine.threads import OneThread


class RowsAttention:
    """`Attention` over a step's rows: the stacked q/k/v cut back into sequences, each over its own cache.

    A decode row is one token. Decode rows in the block pool go together where that is cheaper
    (`pooled_rows`: one write, one gather and one SDPA per layer for all of them); any other takes
    the eager step's path where its cache allows (`lean`): its K/V copied straight into the slot
    for its position through the cache's per-layer views, then single-query attention
    (`_decode_row`). The decode rows run on one intra-op thread (the attention of one query is
    too small to share, see `threads.OneThread`), prompt chunks on all of them.
    """

    def __init__(
        self, rows: list[Row], model: Transformer, groups: list[PoolGroup], paged: frozenset[int] = frozenset()
    ) -> None:
        self.rows = rows
        self.lengths = [len(r.ids) for r in rows]
        self.queries = list(self.lengths)  # query positions per row that go on past the K/V write
        self.offsets = [sum(self.lengths[:i]) for i in range(len(rows))]
        self.lean = [r.plain(model) and not r.cache.borrowed and r.cache.contiguous for r in rows]
        self.scale, self.ops = model.scale, model.ops
        # The chunk rows the plan sends through the C chunk kernel over their blocks in place (`paged`,
        # `shared_step.paged_chunks`); the others gather their keys.
        round_ = self.ops.prompt_attention is attend_chunk_rounded
        self.paged = [PagedChunk(r.cache, r.start, self.scale, round_) if i in paged else None  # type: ignore[arg-type]
                      for i, r in enumerate(rows)]  # fmt: skip
        self.pooled: list[tuple[PooledRows, list[int]]] = []  # each group and its rows, in order
        threads = torch.get_num_threads()  # the C kernel's, which shares its rows out itself
        for group in groups:
            chosen = list(group.rows)
            at = [self.offsets[i] for i in chosen]
            caches = [rows[i].cache for i in chosen]
            starts = [rows[i].start for i in chosen]
            pooled = PooledRows(group.segment, caches, starts, at, at, self.scale, threads,  # type: ignore[arg-type]
                                in_place=group.in_place)  # fmt: skip
            self.pooled.append((pooled, chosen))

    def last_queries_only(self) -> None:
        """From now on each row keeps only its last query, and only when it wants logits (the last layer)."""
        self.queries = [1 if r.logits else 0 for r in self.rows]
        q_at = [sum(self.queries[:i]) for i in range(len(self.rows))]
        for group, chosen in self.pooled:
            group.last_queries_only([q_at[i] for i in chosen])

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_at = [sum(self.queries[:i]) for i in range(len(self.rows))]
        outs: list[torch.Tensor | None] = [None] * len(self.rows)
        with OneThread(q.device):
            for group, chosen in self.pooled:
                together = group(index, q, k, v)
                if len(chosen) == len(self.rows):  # a step of decode rows only, in one segment
                    return together
                for j, i in enumerate(chosen):
                    outs[i] = together[j : j + 1]
            for i in range(len(self.rows)):
                if self.lengths[i] == 1 and outs[i] is None:
                    outs[i] = self._decode_row(i, index, q, k, v, q_at[i])
        for i in range(len(self.rows)):
            if self.lengths[i] > 1:
                outs[i] = self._chunk_row(i, index, q, k, v, q_at[i])
        kept = [o for o in outs if o is not None]
        if not kept:  # no row goes on (the last layer of a step of prompt chunks only)
            return q[:0].flatten(1)
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def _decode_row(self, i: int, index: int, q, k, v, q_at: int) -> torch.Tensor | None:
        row, at = self.rows[i], self.offsets[i]
        if self.lean[i]:
            keys, values = (views[index] for views in row.cache.head_views())
            keys.select(1, row.start).copy_(k[at])
            values.select(1, row.start).copy_(v[at])
            row.cache.lengths[index] = end = row.start + 1
            keys, values = keys.narrow(1, 0, end), values.narrow(1, 0, end)
        else:
            keys, values = row.cache.update(index, heads_first(k[at : at + 1]), heads_first(v[at : at + 1]), row.start)
            keys, values = keys[0], values[0]
        if self.queries[i] == 0:
            return None
        if row.observer is not None:
            row.observer.attended(index, q[q_at], keys)
        return self.ops.decode_attention(q[q_at], keys, values, self.scale).view(1, -1)

    def _chunk_row(self, i: int, index: int, q, k, v, q_at: int) -> torch.Tensor | None:
        row, at, length, nq = self.rows[i], self.offsets[i], self.lengths[i], self.queries[i]
        ks, vs = k[at : at + length], v[at : at + length]
        paged = self.paged[i]
        if paged is not None:  # written into its blocks and attended where they lie, nothing gathered
            return paged(index, q[q_at : q_at + nq], ks, vs, nq)
        keys, values = row.cache.update(index, heads_first(ks), heads_first(vs), row.start)
        if nq == 0:
            return None
        rq = q[q_at : q_at + nq]
        if row.observer is not None:
            row.observer.attended(index, rq[-1], keys[0])
        # Every query of the chunk, or in the last layer its last position's alone: the prompt attention either
        # way, as a chunk attended in place (`PagedChunk`) and a prompt alone (`CacheAttention`) are.
        out = self.ops.prompt_attention(heads_first(rq), keys, values, row.start + length - nq, self.scale)
        return out[0].transpose(0, 1).reshape(nq, -1)
