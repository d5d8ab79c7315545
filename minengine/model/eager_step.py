"""The eager single-token decode step, with as few operations per layer as the arithmetic allows.

A decode step streams every weight once, and between those reads runs a few dozen tiny
operations per layer. Each costs several microseconds, more than in a tight loop because the
weight stream has just evicted the interpreter and dispatcher from the caches (measured: 50 us
for the six operations of one RMSNorm, 12 ms of a 50 ms step outside the projections). So this
step runs `Transformer.block` with a `Scratch`: projections land in buffers whose views (q/k/v
heads, gate and up) are made once, q and k are rotated into a buffer, residuals are added in
place; and its `Attention` copies K/V straight into the cache's slot for the position and pins
attention to one thread inline: about 35 operations per layer instead of 55.

Every arithmetic operation is the one `Transformer.forward` runs, on the same operands in the
same order, so the logits are bit for bit the same; only allocation and view-making are gone.
It serves caches that store K/V as computed (the model's dtype, grouped heads, room for the
position, one buffer per layer: a request's own, or a paged table whose blocks are consecutive);
`runner.ModelRunner` sends anything else down the general path.
"""

from __future__ import annotations

import threading

import torch

from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.attention_rows import SlotKernel
from minengine.model.ops import decode_attention
from minengine.model.transformer import Scratch, Transformer


class EagerDecoder:
    """One-token steps of `Transformer.block` into scratch buffers, for caches that allow them."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._local = threading.local()  # a server decodes several requests on their own threads

    def serves(self, cache: KVCache | PagedKVCache, pos: int) -> bool:
        """Whether the lean step can write position `pos` into `cache`."""
        return (
            not cache.quantized
            and cache.storage_dtype == self.model.dtype
            and cache.heads == self.model.cfg.num_key_value_heads
            and pos < cache.capacity
            and not cache.borrowed
            and cache.contiguous
        )

    def step(self, ids: torch.Tensor, pos: int, cache: KVCache | PagedKVCache) -> torch.Tensor:
        """Logits [vocab] (float32) for the token `ids` [1] at `pos`; writes its K/V into `cache`."""
        model, s = self.model, self._buffers()
        cos, sin = model.rope.lookup_signed(pos, 1)
        attention = SlotAttention(cache, pos, s, model.scale)
        x = model.embed_tokens(ids)  # [1, hidden], a fresh tensor: residuals are added in place
        for i in range(len(model.layers)):
            x = model.block(i, x, cos, sin, attention, s)
        cache.note_written(pos + 1)
        return model.logits(x)

    def _buffers(self) -> Scratch:
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = Scratch.for_model(self.model)
        return s


class SlotAttention:
    """`Attention` for one position of an unborrowed, unquantized grouped-heads cache.

    K/V are copied straight into the slot for `pos` through the cache's per-layer views
    (`KVCache.head_views`, made once), and attention writes into the scratch buffer: in float32
    on the CPU both are one call of the C kernel (`attention_rows.SlotKernel`), the arithmetic
    `ops.decode_attention` runs there too; elsewhere torch's operations, on one thread (see
    `threads.OneThread`), switched inline: this loop is hot.
    """

    __slots__ = ("keys", "values", "pos", "end", "out", "row", "scale", "threads", "kernel")

    def __init__(self, cache: KVCache | PagedKVCache, pos: int, s: Scratch, scale: float) -> None:
        self.keys, self.values = cache.head_views()
        self.pos, self.end = pos, pos + 1
        self.out, self.row = s.attended, s.attended_row
        self.scale = scale
        self.threads = torch.get_num_threads() if cache.device.type == "cpu" else 1
        # float32 on the CPU: the C kernel writes the slot and attends in one call per layer.
        self.kernel = None
        if SlotKernel.serves(s.q, s.k, s.v, s.attended, self.keys[0]):
            self.kernel = SlotKernel(self.keys, self.values, pos, (s.q, s.k, s.v, s.attended), scale)

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # q, k, v are the scratch buffers the kernel was given
            self.kernel(index)
            return self.row
        keys, values = self.keys[index], self.values[index]
        keys.select(1, self.pos).copy_(k)
        values.select(1, self.pos).copy_(v)
        if self.threads > 1:
            torch.set_num_threads(1)
        decode_attention(q, keys.narrow(1, 0, self.end), values.narrow(1, 0, self.end), self.scale, out=self.out)
        if self.threads > 1:
            torch.set_num_threads(self.threads)
        return self.row
