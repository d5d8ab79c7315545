"""A request's KV cache as a table of blocks in the engine's `BlockPool`.

It offers what the model and a session use of `KVCache` (`update`, `usage`, `lengths`,
`release`, and the attributes describing its storage), so `CacheAttention` and the decode steps
run on it unchanged. Blocks are allocated when a position first needs one (`make_room`); when
the pool has none left, `PoolExhausted` says so and the caller decides (the step loop preempts).

Reading K/V is the hot part. When the table's blocks are consecutive in one segment (the pool
places a request's blocks that way whenever it can), every layer's K and V for [0, end) is one
strided view of the segment, the same view a request-owned buffer gives, so attention reads it
in place and the lean single-token step (`eager_step`) serves it through `head_views`. A table
split over several runs (a prefix-cache hit followed by blocks of its own, a crowded pool)
gathers its runs into one tensor per layer and step, which costs a copy of the context.

A prefix-cache hit is attached by reference (`attach_prefix`): those blocks stay shared and
are never written. A write into a block someone else also holds copies it first (copy on
write); with the prefix cache's rule (only full blocks, never the prompt's last token) that
never happens, since every write lands past the shared blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minengine.config import ModelConfig
from minengine.kv.arithmetic import blocks_for
from minengine.kv.block_pool import PREFIX, BlockFormat, BlockPool, Segment
from minengine.kv.cache import dequantize_fp8, quantize_fp8
from minengine.kv.usage import KV_LAYOUTS, BlockSharing, KVUsage


@dataclass(frozen=True)
class Freed:
    """What releasing a cache gave back: the blocks that went back to the free list, and their bytes.

    Blocks someone else still holds (the prefix cache, another request) stay held and are not counted.
    """

    blocks: int
    nbytes: int


_Views = tuple[tuple[list[torch.Tensor], ...], tuple[list[torch.Tensor], ...]]
_NO_VIEWS: _Views = (([], [], [], []), ([], []))


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of the table within one segment."""

    segment: Segment
    local: int  # the run's first position in the segment
    start: int  # the run's first position in the request
    tokens: int


class PagedKVCache:
    """K/V storage for one request across all layers of one model, in pool blocks."""

    borrowed = False  # never in a lender's buffers (the static decoder's arena)

    def __init__(
        self,
        pool: BlockPool,
        cfg: ModelConfig,
        *,
        owner: str,
        device: torch.device,
        compute_dtype: torch.dtype,
        layout: str = "gqa",
        storage_dtype: torch.dtype | None = None,
        block_size: int = 16,
        expect_tokens: int = 0,
    ) -> None:
        """An empty table for `owner` (its name in the pool's counters); `expect_tokens` is how
        many positions it will probably hold (prompt and max_tokens), so the pool can keep room
        for them next to its first blocks."""
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; choose one of {', '.join(KV_LAYOUTS)}")
        if block_size < 1:
            raise ValueError("block size must be at least 1")
        if owner == PREFIX:
            raise ValueError(f"{PREFIX!r} names the prefix cache's references; a request needs a name of its own")
        self.pool, self.cfg, self.owner = pool, cfg, owner
        self.layout, self.block_size, self.device = layout, block_size, device
        self.compute_dtype = compute_dtype
        self.storage_dtype = storage_dtype or compute_dtype
        self.quantized = self.storage_dtype == torch.float8_e4m3fn
        self.heads = cfg.num_attention_heads if layout == "mha" else cfg.num_key_value_heads
        self.format = BlockFormat(cfg.num_hidden_layers, self.heads, cfg.head_dim, block_size, self.storage_dtype)
        self.store = pool.store(self.format)
        self.expect_blocks = blocks_for(expect_tokens, block_size)
        self.lengths = [0] * cfg.num_hidden_layers
        self.blocks: list[int] = []  # the block table: block i holds positions [i*block_size, (i+1)*block_size)
        self._usage: tuple[tuple, KVUsage] | None = None  # the last `usage`, and what it was made from
        self._sharing: tuple[tuple[int, int], BlockSharing] | None = None  # the last `usage`'s sharing, and its key
        self.attached = 0  # leading blocks shared in from the prefix cache
        self.contiguous = True  # the table is one run of consecutive blocks
        self._runs: list[Run] = []
        # Over the one run of a contiguous table: per layer K, V (and FP8 scales) [1, heads, capacity, d],
        # and K, V [heads, capacity, d] for the lean step; made when first wanted after the table
        # changes (`_run_views`), since a shared step's C kernel reads the table, not the views.
        self._views_made: _Views | None = _NO_VIEWS

    # -- the block table --------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Positions the blocks held now have room for."""
        return len(self.blocks) * self.block_size

    def blocks_needed(self, end: int) -> int:
        """New blocks positions [0, end) would take beyond those held."""
        return max(0, blocks_for(end, self.block_size) - len(self.blocks))

    def make_room(self, end: int) -> None:
        """Hold blocks for every position below `end` (raises `PoolExhausted` when the pool has none)."""
        need = self.blocks_needed(end)
        if not need:
            return
        after = self.blocks[-1] if self.blocks else None
        expect = max(need, self.expect_blocks - len(self.blocks))
        new = self.pool.allocate(self.format, self.owner, need, after=after, expect=expect)
        self._append(new)

    def attach_prefix(self, blocks: list[int]) -> None:
        """Share the prefix cache's `blocks` (full ones, in order) as this empty cache's first positions."""
        if self.blocks or self.tokens:
            raise ValueError("a prefix is attached to an empty cache only")
        self.pool.share(self.format, blocks, self.owner)
        self.attached = len(blocks)
        self._append(list(blocks))
        self.lengths = [self.capacity] * self.cfg.num_hidden_layers

    def _append(self, new: list[int]) -> None:
        if not new:
            return
        chain = ([self.blocks[-1]] if self.blocks else []) + new
        self.contiguous = self.contiguous and all(b + 1 == c for b, c in zip(chain, chain[1:], strict=False))
        self.blocks.extend(new)
        self._runs = self._make_runs()
        self._views_made = None

    def _run_views(self) -> _Views:
        """The views over the table's one run (none for a table of several), made on first use:
        30 layers' worth took 0.1-0.2 ms each time a block was added, 8 requests' blocks a step."""
        if self._views_made is None:
            self._views_made = self._view_run(self._runs[0]) if self.contiguous else _NO_VIEWS
        return self._views_made

    @torch.inference_mode(False)
    def _view_run(self, run: Run) -> _Views:
        """Per-layer views of one run, [1, heads, tokens, d] and [heads, tokens, d]: normal views
        of the segment's normal tensors, even when made in a forward pass (see `Segment`)."""
        views: tuple[list[torch.Tensor], ...] = ([], [], [], [])
        for i in range(self.cfg.num_hidden_layers):
            for out, t in zip(views, self._tensors(run.segment), strict=True):
                if t is not None:
                    out.append(t[i : i + 1].narrow(2, run.local, run.tokens))
        return views, ([k[0] for k in views[0]], [v[0] for v in views[1]])

    def _make_runs(self) -> list[Run]:
        runs: list[Run] = []
        size = self.block_size
        for i, b in enumerate(self.blocks):
            if runs and b == self.blocks[i - 1] + 1:
                last = runs[-1]
                runs[-1] = Run(last.segment, last.local, last.start, last.tokens + size)
            else:
                seg = self.store.segment_of(b)
                runs.append(Run(seg, (b - seg.first) * size, i * size, size))
        return runs

    @staticmethod
    def _tensors(seg: Segment) -> tuple[torch.Tensor | None, ...]:
        return seg.k, seg.v, seg.k_scale, seg.v_scale

    def runs(self, end: int) -> list[Run]:
        """Where positions [0, end) lie, in order: the table's runs, the last cut at `end`."""
        return [
            run if run.start + run.tokens <= end else Run(run.segment, run.local, run.start, end - run.start)
            for run in self._runs
            if run.start < end
        ]

    def head_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V over the held blocks, [heads, capacity, head_dim] (one run only)."""
        if not self.contiguous:
            raise ValueError("a table of several runs has no single view; read it through update")
        return self._run_views()[1]

    def note_written(self, end: int) -> None:
        """Record that every layer now holds positions [0, end), written in place through `head_views`."""
        self.lengths = [end] * self.cfg.num_hidden_layers

    # -- K/V in and out ---------------------------------------------------------------------------

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [1, kv_heads, T, head_dim] at positions [start, start+T) of `layer`.

        Returns K and V for positions [0, start+T) in the compute dtype, with `self.heads` heads,
        as `KVCache.update` does.
        """
        self.write(layer, k, v, start)
        return self.read(layer, start + k.shape[2])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k/v [1, kv_heads, T, head_dim] at positions [start, start+T) of `layer`, reading
        nothing back (for a kernel that reads the table's runs where they lie: `fast.chunk_attention`)."""
        end = start + k.shape[2]
        if end > self.capacity:
            self.make_room(end)
        if start < self.attached * self.block_size:
            self._own_blocks(start, end)
        if self.layout == "mha" and self.heads != k.shape[1]:
            groups = self.heads // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.quantized:
            kq, ks = quantize_fp8(k)
            vq, vs = quantize_fp8(v)
            self._write(layer, start, end, (kq, vq, ks, vs))
        else:
            self._write(layer, start, end, (k, v))
        self.lengths[layer] = end

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for positions [0, end) as `update` returns them, writing nothing."""
        if self.quantized:
            keys, values, key_scales, value_scales = self._read(layer, end, 4)
            dtype = self.compute_dtype
            return dequantize_fp8(keys, key_scales, dtype), dequantize_fp8(values, value_scales, dtype)
        keys, values = self._read(layer, end, 2)
        if self.storage_dtype != self.compute_dtype:
            return keys.to(self.compute_dtype), values.to(self.compute_dtype)
        return keys, values

    def _write(self, layer: int, start: int, end: int, parts: tuple[torch.Tensor, ...]) -> None:
        if self.contiguous:
            for view, x in zip(self._run_views()[0], parts, strict=False):
                view[layer].narrow(2, start, end - start).copy_(x)
            return
        for run in self._runs:
            lo, hi = max(start, run.start), min(end, run.start + run.tokens)
            if lo >= hi:
                continue
            for t, x in zip(self._tensors(run.segment), parts, strict=False):
                t[layer].narrow(1, run.local + lo - run.start, hi - lo).copy_(x[0].narrow(1, lo - start, hi - lo))

    def _read(self, layer: int, end: int, n: int) -> list[torch.Tensor]:
        """The first `n` of K, V, K scales, V scales for positions [0, end), [1, heads, end, ...] each."""
        if self.contiguous:
            views = self._run_views()[0]
            return [views[j][layer].narrow(2, 0, end) for j in range(n)]
        out = []
        for j in range(n):
            pieces = [
                self._tensors(run.segment)[j][layer].narrow(1, run.local, min(run.tokens, end - run.start))
                for run in self._runs
                if run.start < end
            ]
            out.append(torch.cat(pieces, dim=1).unsqueeze(0))
        return out

    def _own_blocks(self, start: int, end: int) -> None:
        """Copy each block in [start, end) that someone else also holds into a block of this cache's own."""
        size = self.block_size
        for i in range(start // size, min(blocks_for(end, size), self.attached)):
            old = self.blocks[i]
            if self.pool.refs(self.format, old) == 1:
                continue
            new = self.pool.allocate(self.format, self.owner, 1)[0]
            src, dst = self.store.segment_of(old), self.store.segment_of(new)
            a, b = (old - src.first) * size, (new - dst.first) * size
            for s, d in zip(self._tensors(src), self._tensors(dst), strict=True):
                if s is not None:
                    d.narrow(2, b, size).copy_(s.narrow(2, a, size))
            self.pool.free(self.format, [old], self.owner)
            self.blocks[i] = new
        self.attached = min(self.attached, start // size)
        tail, self.blocks, self.contiguous = self.blocks, [], True
        self._append(tail)

    # -- accounting -------------------------------------------------------------------------------

    @property
    def valid_tokens(self) -> int:
        """Positions every layer holds: a pass that failed partway leaves later layers shorter."""
        return min(self.lengths) if self.lengths else 0

    @property
    def tokens(self) -> int:
        """Positions held (the most any layer holds)."""
        return max(self.lengths) if self.lengths else 0

    def full_blocks(self, tokens: int | None = None) -> list[int]:
        """The blocks every layer has filled, in order (of the first `tokens` positions, when given)."""
        held = self.valid_tokens if tokens is None else min(tokens, self.valid_tokens)
        return self.blocks[: held // self.block_size]

    def usage(self, lengths: tuple[int, ...] | None = None) -> KVUsage:
        """Bytes held now: logical (per token, the seeds' formula), physical (the blocks really held,
        a shared one in full), and those blocks by who else holds them (`sharing`). With `lengths`
        (per layer, as the cache held them after a step), as of then: the blocks those positions
        take, though the table may have grown since (a request the loop runs ahead).

        Kept until the cache or the pool's references change: a decode step asks for it several
        times (the step's read, the request's token), 8 requests a step, and building it took tens
        of microseconds a time. Each token of a request asks with its own lengths, so the whole is
        new each time; the format's byte counts are made once (`BlockFormat`), and the blocks'
        sharing (a walk of the table under the pool's lock) is kept apart until the table's length
        or the pool's references change (the figures: docs/history.md, "The 2-core Zen 5 EPYC:
        unsteered decode, the attention kernel and the tiles"). A shared step's consumers run
        beside its kernels, on the same two cores.
        """
        lengths = tuple(self.lengths) if lengths is None else lengths
        tokens = max(lengths) if lengths else 0
        held = len(self.blocks) if lengths is None else min(len(self.blocks), blocks_for(tokens, self.block_size))
        changes = self.pool.changes
        key = (lengths, held, changes)
        memo = self._usage  # read once: the model thread may replace it meanwhile
        if memo is not None and memo[0] == key:
            return memo[1]
        shared = self._sharing
        if shared is None or shared[0] != (held, changes):
            shared = self._sharing = ((held, changes), self.pool.sharing(self.format, self.blocks[:held]))
        cfg, fmt, layers = self.cfg, self.format, self.cfg.num_hidden_layers
        per_token = fmt.payload_bytes // self.block_size  # the seeds' formula, all layers
        per_layer_token = per_token // layers
        physical = held * fmt.nbytes
        usage = KVUsage(
            layout=self.layout,
            dtype=str(self.storage_dtype).removeprefix("torch."),
            tokens=tokens,
            block_size=self.block_size,
            blocks=blocks_for(tokens, self.block_size),
            layers=layers,
            stored_heads=self.heads,
            head_dim=cfg.head_dim,
            bytes_per_token=per_token,
            logical_bytes=per_layer_token * sum(lengths),
            physical_bytes=physical,
            reserved_bytes=physical,  # nothing is held beyond the blocks
            per_layer_tokens=lengths,
            per_layer_logical_bytes=tuple(map(per_layer_token.__mul__, lengths)),
            per_layer_physical_bytes=(fmt.nbytes // layers * held,) * layers,
            sharing=shared[1],
        )
        self._usage = (key, usage)
        return usage

    def sharing(self) -> BlockSharing:
        """This cache's blocks: its own, shared with other requests, shared with the prefix cache only."""
        return self.pool.sharing(self.format, self.blocks)

    def release(self) -> Freed:
        """Drop this cache's references; what went back to the pool (shared blocks stay with their other holders)."""
        returned = self.pool.free(self.format, self.blocks, self.owner) if self.blocks else 0
        self.pool.unclaim(self.format, self.owner)
        self.blocks, self.attached, self.contiguous = [], 0, True
        self._runs, self._views_made = [], _NO_VIEWS
        self.lengths = [0] * self.cfg.num_hidden_layers
        return Freed(returned, returned * self.format.nbytes)
