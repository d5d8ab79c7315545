"""Decode with static shapes: one step captured in a CUDA graph and replayed for every token.

A captured graph replays fixed kernels on fixed addresses, so everything a decode step touches
must exist before capture and keep its shape: the token and its position live in one-element
device buffers, K/V live in a zeroed arena of fixed capacity that request caches borrow, and
attention reads a fixed window of the arena (the filled prefix rounded up to a multiple of
`SPAN` tokens) with the positions after the current one masked out. One graph is kept per
window length, so a step costs one launch instead of several hundred, and a long arena is not
read in full while the request is still short.

Without capture (the CPU, or `capture=False`) the same static step runs eagerly; that is how
its logic is tested on machines without a GPU.
"""

from __future__ import annotations

import threading

import torch

from minengine.kv.arithmetic import blocks_for
from minengine.kv.cache import KVCache
from minengine.model.ops import decode_attention, heads_first
from minengine.model.transformer import Transformer

SPAN = 256  # attention window granularity, in tokens
MIN_ARENA_TOKENS = 1024


def static_decode_step(
    model: Transformer,
    token: torch.Tensor,
    pos: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: torch.Tensor,
) -> torch.Tensor:
    """Logits [vocab] (float32) for `token` [1] at position `pos` [1] (both device tensors).

    Runs `Transformer.block` with `ArenaAttention`: K/V at `pos` go into `keys`/`values`
    ([1, heads, capacity, head_dim] per layer), and attention reads the first `len(positions)`
    slots, hiding those after `pos`. No operation depends on a host-side value of `pos`, so the
    step can be captured.
    """
    x = model.embed_tokens(token)  # [1, hidden]
    cos = model.rope.cos.index_select(0, pos)[:, None]  # [1, 1, head_dim]
    sin = model.rope.signed_sin.index_select(0, pos)[:, None]
    attention = ArenaAttention(keys, values, pos, positions, model.scale)
    for i in range(len(model.layers)):
        x = model.block(i, x, cos, sin, attention)
    return model.logits(x)


class ArenaAttention:
    """`Attention` for one position in the static arena, addressed by a device tensor `pos`."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        pos: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> None:
        self.keys, self.values, self.pos, self.scale = keys, values, pos, scale
        self.span = positions.shape[0]
        self.hidden = positions > pos  # [span]: slots this request has not written yet

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.keys[index], self.values[index]
        k, v = heads_first(k), heads_first(v)  # [1, Hkv, 1, d]
        stored_heads = keys.shape[1]
        if stored_heads != k.shape[1]:  # the mha layout stores one K/V head per query head
            k = k.repeat_interleave(stored_heads // k.shape[1], dim=1)
            v = v.repeat_interleave(stored_heads // v.shape[1], dim=1)
        keys.index_copy_(2, self.pos, k)
        values.index_copy_(2, self.pos, v)
        span = self.span
        attended = decode_attention(q[0], keys[0, :, :span], values[0, :, :span], self.scale, hidden=self.hidden)
        return attended.view(1, -1)


class StaticDecoder:
    """Static buffers, a K/V arena lent to one request at a time, and the captured graphs."""

    def __init__(self, model: Transformer, *, capture: bool) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graph capture needs a CUDA device")
        self.model = model
        self.capture = capture
        device = model.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.heads = 0
        self.positions = torch.empty(0, dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._rope_table: torch.Tensor | None = None
        self._lent = False
        self._lock = threading.Lock()
        self.captures = 0  # graphs captured so far (the benchmark reports it)

    # -- lending the arena ---------------------------------------------------------------------

    def new_cache(self, tokens: int, *, layout: str, block_size: int) -> KVCache | None:
        """A cache over the arena for `tokens` positions, or None while it is lent out."""
        model = self.model
        heads = model.cfg.num_attention_heads if layout == "mha" else model.cfg.num_key_value_heads
        need = blocks_for(max(tokens, 1), block_size) * block_size
        with self._lock:
            if self._lent:
                return None
            if need > self.capacity or heads != self.heads:
                self._allocate(max(need, MIN_ARENA_TOKENS), heads)
            self._lent = True
        return KVCache(
            model.cfg,
            need,
            device=model.device,
            compute_dtype=model.dtype,
            layout=layout,
            block_size=block_size,
            buffers=(self.keys, self.values),
            on_release=self._returned,
        )

    def _returned(self) -> None:
        with self._lock:
            self._lent = False

    def _allocate(self, tokens: int, heads: int) -> None:
        model, cfg = self.model, self.model.cfg
        capacity = blocks_for(tokens, SPAN) * SPAN
        shape = (1, heads, capacity, cfg.head_dim)
        # Zeros, not empty: masked slots are multiplied by probability 0, and 0 * NaN is NaN.
        self.keys = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.values = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.positions = torch.arange(capacity, device=model.device)
        self.capacity, self.heads = capacity, heads
        model.rope.ensure(capacity)
        self._graphs.clear()

    @property
    def arena_bytes(self) -> int:
        """Bytes of the K/V arena (what lending reserves on the device)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # -- stepping ------------------------------------------------------------------------------

    def serves(self, cache: KVCache) -> bool:
        """Whether `cache` still decodes in this decoder's arena."""
        return cache.borrowed and cache.on_release == self._returned

    def step(self, ids: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """Decode token `ids` [1] at `pos` for `cache` (which must be `serves`-able); logits [vocab]."""
        span = min(self.capacity, blocks_for(pos + 1, SPAN) * SPAN)
        self.token.copy_(ids.reshape(1))
        self.pos.fill_(pos)
        if self.capture:
            logits = self._replay(span)
        else:
            logits = static_decode_step(self.model, self.token, self.pos, self.keys, self.values, self.positions[:span])
        cache.note_written(pos + 1)
        # The captured output is overwritten by the next replay; callers keep logits longer.
        return logits.clone()

    def _replay(self, span: int) -> torch.Tensor:
        if self._rope_table is not self.model.rope.cos:  # the table grew: graphs point at the old one
            self._graphs.clear()
            self._rope_table = self.model.rope.cos
        entry = self._graphs.get(span)
        if entry is None:
            entry = self._graphs[span] = self._capture(span)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        def run() -> torch.Tensor:
            return static_decode_step(self.model, self.token, self.pos, self.keys, self.values, self.positions[:span])

        # Warm up on a side stream so lazy initialisation (cuBLAS handles, workspaces, cached
        # constants) happens before capture. Each run writes the same K/V at `pos`, so the
        # repeats are harmless.
        device = self.model.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = run()
        self.captures += 1
        return graph, logits
