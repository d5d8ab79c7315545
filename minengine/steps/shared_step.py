"""One forward pass over several sequences of different lengths: the shared step of a batch.

Decode is memory-bound: a step streams every weight once whether it multiplies one row or
eight. So the step stacks every scheduled token of every sequence (one per decoding
sequence, a chunk of prompt for each prefilling one) into one [tokens, hidden] residual
stream, and the projections and the MLP run over all of it: each weight is read once per
step. Only attention is per sequence: each row writes its K/V into its own cache and its
queries attend over that cache alone (`rows_attention.RowsAttention`): decode rows in the block pool
together (`pooled_rows`, read in place by the C kernel of `attention_rows` where it runs),
another one query through the single-query kernel, a chunk through SDPA with the causal
offset mask.

The arithmetic per token is `Transformer.forward`'s; only the matrix shapes differ (a GEMM
over the step's rows instead of a GEMV), and a BLAS may sum a row in another order then. So a
sequence's logits in a batch can differ from its logits alone in the last bits, which can
flip a near-tie under greedy decoding (tests/engine/test_batching.py measures how often).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minengine.fast.attention_rows import serves_store
from minengine.fast.chunk_attention import in_place
from minengine.fast.eager_step import LayerStack
from minengine.fast.pooled_rows import pooled_count
from minengine.kv.block_pool import Segment
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.transformer import Transformer
from minengine.steps.rows import PoolGroup, Row
from minengine.steps.rows_attention import RowsAttention


def pool_groups(rows: list[Row], model: Transformer) -> list[PoolGroup]:
    """Which decode rows attend together, a group per pool segment: all of a segment's where the C
    kernel reads it in place, else as many as `pooled_count`'s costs find cheaper. Part of the
    step's plan (`ModelRunner.pick_rows`), made before it runs."""
    members: dict[Segment, list[int]] = {}
    for i, r in enumerate(rows):
        segment = _pool_segment(r) if r.plain(model) else None
        if segment is not None:
            members.setdefault(segment, []).append(i)
    groups = []
    for segment, found in members.items():
        count = pooled_rows_count(segment, [rows[i].start + 1 for i in found])
        if count:
            chosen = sorted(sorted(found, key=lambda i: rows[i].start)[:count])
            groups.append(PoolGroup(segment, tuple(chosen), serves_store(segment.k)))
    return groups


def paged_chunks(rows: list[Row], model: Transformer) -> frozenset[int]:
    """The prompt-chunk rows whose attention reads their paged blocks in place (`PagedChunk`): where the
    model's prompt attention is the C chunk kernel (bound at load) and the row is not observed (an
    observer is handed the gathered keys). Part of the step's plan (`ModelRunner.pick_rows`)."""
    return frozenset(
        i for i, r in enumerate(rows)
        if len(r.ids) > 1 and r.observer is None and in_place(model.ops.prompt_attention, r.cache)
    )  # fmt: skip


def stacked_group(model: Transformer, rows: list[Row]) -> PoolGroup | None:
    """The one group holding every one of these decode rows, in a segment the C kernel reads in
    place, which the C stack over rows needs (`run_stacked`); None where there is none."""
    if any(r.observer is not None or not r.logits for r in rows):
        return None
    groups = pool_groups(rows, model)
    if len(groups) != 1 or len(groups[0].rows) != len(rows) or not groups[0].in_place:
        return None
    return groups[0]


def pooled_rows_count(segment: Segment, lengths: list[int]) -> int:
    """How many of a segment's decode rows, shortest first, attend together (`PooledRows`), given
    their context lengths: all of them where the C kernel reads the segment in place (it gathers
    nothing, so together is cheaper at any length), else what `pooled_count`'s costs say."""
    if serves_store(segment.k):
        return len(lengths)
    return pooled_count(lengths) if len(lengths) > 1 else 0


def _pool_segment(row: Row) -> Segment | None:
    """The pool segment that holds every position of a decode row's cache up to its new one
    (`PooledRows` reads them by position), if there is one: a paged cache, writing past any
    block it shares, that wants its logits. A row whose attention must be seen on its own
    (an observer's) answers None here and keeps `_decode_row`."""
    cache = row.cache
    if row.observer is not None or not isinstance(cache, PagedKVCache) or not row.logits:
        return None
    if row.start < cache.attached * cache.block_size:
        return None
    runs = cache.runs(row.start + 1)
    segment = runs[0].segment
    return segment if all(run.segment is segment for run in runs) else None


def _inputs(model: Transformer, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's stacked embeddings [tokens, hidden] and their rotary rows."""
    ids = torch.tensor([t for r in rows for t in r.ids], device=model.device)
    x = model.embed_tokens(ids)
    if len(ids) == len(rows) > 1:  # decode rows only: a position each
        cos, sin = model.rope.lookup_signed_at([r.start for r in rows])
        return x, cos, sin
    tables = [model.rope.lookup_signed(r.start, len(r.ids)) for r in rows]
    cos = torch.cat([c for c, _ in tables]) if len(rows) > 1 else tables[0][0]
    sin = torch.cat([s for _, s in tables]) if len(rows) > 1 else tables[0][1]
    return x, cos, sin


@torch.inference_mode()
def run_stacked(
    model: Transformer,
    rows: list[Row],
    group: PoolGroup,
    stack: LayerStack,
    computing: Callable[[], object] | None = None,
) -> list[torch.Tensor | None]:
    """A step of decode rows only, attended together by the C kernel in one pool segment (`group`),
    through the C stack of every block (`eager_step.LayerStack`): the logits `run_blocks` gives,
    bit for bit, without its per-layer dispatches."""
    x, cos, sin = _inputs(model, rows)
    attention = RowsAttention(rows, model, [group])
    pooled, _ = attention.pooled[0]
    logits = stack.rows(x, cos, sin, pooled.kernel, pooled.segment, computing)
    for cache, end in zip(pooled.caches, pooled.ends, strict=True):  # as `PooledRows` records each layer
        cache.lengths[:] = [end] * len(cache.lengths)
    return list(model.logits(x, per_position=True) if logits is None else logits)


def forward_rows(
    model: Transformer, rows: list[Row], computing: Callable[[], object] | None = None
) -> list[torch.Tensor | None]:
    """Run every row's tokens through `model`'s Python blocks in one pass; each row's next-token
    logits [vocab] (float32), or None for a row that asked for none (a prompt chunk before the
    last). `computing` is called once the inputs are laid out, before the blocks run."""
    return run_blocks(model, rows, pool_groups(rows, model), paged_chunks(rows, model), computing)


@torch.inference_mode()
def run_blocks(
    model: Transformer,
    rows: list[Row],
    groups: list[PoolGroup],
    paged: frozenset[int],
    computing: Callable[[], object] | None = None,
) -> list[torch.Tensor | None]:
    """The Python blocks over the stacked rows, the decode rows in `groups` attended together, the
    chunk rows in `paged` over their blocks in place."""
    if not rows:
        return []
    x, cos, sin = _inputs(model, rows)
    attention = RowsAttention(rows, model, groups, paged)
    if computing is not None:
        computing()
    # The rows whose last position's logits are wanted: only they go on past the last K/V write.
    ends, at = [], 0
    for r in rows:
        at += len(r.ids)
        if r.logits:
            ends.append(at - 1)
    last = len(model.layers) - 1
    # Observed rows (inspection) and their last position in the stacked tokens.
    observed = [(r.observer, sum(len(p.ids) for p in rows[: n + 1]) - 1)
                for n, r in enumerate(rows) if r.observer is not None and r.logits]  # fmt: skip
    for i in range(last):
        x = model.block(i, x, cos, sin, attention)
        for observer, at in observed:
            observer.residual(i, x[at])
    attention.last_queries_only()
    if not ends:  # prompt chunks only: the last layer just stores its K/V
        layer = model.layers[last]
        attention(last, *model.qkv_heads(layer, layer.input_norm(x), cos, sin))
        return [None] * len(rows)
    keep = torch.tensor(ends, device=model.device, dtype=torch.long)
    x = model.block(last, x, cos, sin, attention, keep=keep)
    for observer, at in observed:
        observer.residual(last, x[ends.index(at)])
    logits = model.logits(x, per_position=True)
    out: list[torch.Tensor | None] = []
    n = 0
    for r in rows:
        if r.logits:
            out.append(logits[n])
            n += 1
        else:
            out.append(None)
    return out
