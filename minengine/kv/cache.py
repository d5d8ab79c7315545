"""The request-owned KV cache, measured.

Each layer stores K and V in one buffer reserved up front for the request's token budget
(prompt + max_tokens, rounded up to whole blocks), shaped [1, heads, capacity, head_dim].
Tokens are written in place at their position, so growing the cache never copies what is
already there, and attention reads a view of the filled prefix. Memory is accounted in
fixed-size token blocks: a block counts as physically allocated once any token lands in it.
On the CPU the reservation is lazily committed by the OS, so untouched blocks cost nothing.

Two layouts: `gqa` keeps the model's own KV heads; `mha` stores K/V expanded to one head per
query head, exactly what an otherwise identical MHA model would hold. Outputs are identical;
bytes and decode time are not. `float8_e4m3fn` storage keeps one byte per element plus one
float32 scale per token and head, dequantized for attention.

A request's K/V can also be taken out and put back (`read_span`, `write_prefix`) as a
`KVSpan`: every layer's K and V for a run of positions, stacked, in the storage dtype (FP8
with its scales), byte for byte what the cache holds. The prefix cache keeps finished requests'
blocks that way and copies them into the next request that starts with the same tokens.

A cache can also borrow its buffers (`buffers=`) from a lender that keeps them between
requests, such as the static decoder behind CUDA graphs, whose captured kernels only work on
the addresses they were captured with. Borrowed buffers are given back on `release()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minengine.config import ModelConfig
from minengine.kv.arithmetic import blocks_for, kv_bytes_per_token
from minengine.kv.usage import KV_LAYOUTS, KVUsage

_FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] as float8_e4m3fn, and the float32 scale of each vector [..., 1] (its absmax / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / _FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 `payload` times its `scales`, in `dtype`."""
    return (payload.float() * scales).to(dtype)


@dataclass(frozen=True)
class KVSpan:
    """K/V of a run of positions in every layer, as a cache stores them.

    keys/values are [layers, heads, tokens, head_dim] in the storage dtype; FP8 storage adds its
    per-token, per-head scales, [layers, heads, tokens, 1] float32 (None otherwise).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Positions the span holds."""
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor in the span (scales included)."""
        parts = (self.keys, self.values, self.key_scales, self.value_scales)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def piece(self, start: int, length: int) -> KVSpan:
        """Positions [start, start+length) as a span of its own (copied: it keeps nothing else alive)."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.narrow(2, start, length).clone()

        return KVSpan(cut(self.keys), cut(self.values), cut(self.key_scales), cut(self.value_scales))

    @staticmethod
    def joined(spans: list[KVSpan]) -> KVSpan:
        """The spans one after another, as one span."""

        def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if parts[0] is None else torch.cat(parts, dim=2)

        return KVSpan(
            cat([s.keys for s in spans]),
            cat([s.values for s in spans]),
            cat([s.key_scales for s in spans]),
            cat([s.value_scales for s in spans]),
        )


class KVCache:
    """K/V storage for one request across all layers of one model."""

    contiguous = True  # each layer's K and V for [0, capacity) is one buffer (as `PagedKVCache` asks of its table)

    def __init__(
        self,
        cfg: ModelConfig,
        capacity: int,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        layout: str = "gqa",
        storage_dtype: torch.dtype | None = None,
        block_size: int = 16,
        buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; choose one of {', '.join(KV_LAYOUTS)}")
        if block_size < 1:
            raise ValueError("block size must be at least 1")
        self.cfg = cfg
        self.layout = layout
        self.block_size = block_size
        self.device = device
        self.compute_dtype = compute_dtype
        self.storage_dtype = storage_dtype or compute_dtype
        self.quantized = self.storage_dtype == torch.float8_e4m3fn
        self.heads = cfg.num_attention_heads if layout == "mha" else cfg.num_key_value_heads
        self.lengths = [0] * cfg.num_hidden_layers
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._k_scale: list[torch.Tensor] = []
        self._v_scale: list[torch.Tensor] = []
        self._heads_of: list[torch.Tensor] | None = None  # the buffers `_head_views` were made from
        self._head_views: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.capacity = 0
        self.on_release = on_release
        self.borrowed = buffers is not None  # True while K/V live in lent buffers
        if buffers is not None:
            self._borrow(buffers, capacity)
        else:
            self._allocate(capacity)

    # -- storage -----------------------------------------------------------------------------

    def _allocate(self, tokens: int) -> None:
        capacity = blocks_for(max(tokens, 1), self.block_size) * self.block_size
        shape = (1, self.heads, capacity, self.cfg.head_dim)
        old = (self._k, self._v, self._k_scale, self._v_scale, self.capacity)
        n = self.cfg.num_hidden_layers
        self._k = [torch.empty(shape, device=self.device, dtype=self.storage_dtype) for _ in range(n)]
        self._v = [torch.empty(shape, device=self.device, dtype=self.storage_dtype) for _ in range(n)]
        if self.quantized:
            sshape = (1, self.heads, capacity, 1)
            self._k_scale = [torch.empty(sshape, device=self.device) for _ in range(n)]
            self._v_scale = [torch.empty(sshape, device=self.device) for _ in range(n)]
        self.capacity = capacity
        # Outgrowing the reservation (a caller decoding past its budget) is rare: copy once,
        # doubling, so the amortised cost stays constant per token.
        for i, filled in enumerate(self.lengths):
            if filled:
                self._k[i][:, :, :filled] = old[0][i][:, :, :filled]
                self._v[i][:, :, :filled] = old[1][i][:, :, :filled]
                if self.quantized:
                    self._k_scale[i][:, :, :filled] = old[2][i][:, :, :filled]
                    self._v_scale[i][:, :, :filled] = old[3][i][:, :, :filled]

    def _borrow(self, buffers: tuple[list[torch.Tensor], list[torch.Tensor]], tokens: int) -> None:
        keys, values = buffers
        n = self.cfg.num_hidden_layers
        shape = (1, self.heads, keys[0].shape[2] if keys else 0, self.cfg.head_dim)
        if self.quantized or len(keys) != n or len(values) != n:
            raise ValueError("lent KV buffers need one K and one V per layer and an unquantized dtype")
        for t in (*keys, *values):
            if tuple(t.shape) != shape or t.dtype != self.storage_dtype or t.device.type != self.device.type:
                got, want = f"{tuple(t.shape)} {t.dtype}", f"{shape} {self.storage_dtype}"
                raise ValueError(f"lent KV buffer {got} does not match {want}")
        if shape[2] < tokens:
            raise ValueError(f"lent KV buffers hold {shape[2]} tokens, fewer than the {tokens} asked for")
        self._k, self._v, self.capacity = list(keys), list(values), shape[2]

    def note_written(self, end: int) -> None:
        """Record that every layer now holds positions [0, end), written in place by a caller
        that bypasses `update` (a captured decode step writing into borrowed buffers)."""
        self.lengths = [end] * self.cfg.num_hidden_layers

    def head_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V buffers without the batch dimension, [heads, capacity, head_dim].

        Made once per set of buffers: the decode step writes and reads through them every step.
        """
        if self._heads_of is not self._k:
            self._head_views = ([k[0] for k in self._k], [v[0] for v in self._v])
            self._heads_of = self._k
        return self._head_views

    def layer_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The per-layer K and V buffers, [1, heads, capacity, head_dim] each (storage dtype)."""
        return self._k, self._v

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [1, kv_heads, T, head_dim] at positions [start, start+T) of `layer`.

        Returns K and V for positions [0, start+T) in the compute dtype, with `self.heads`
        heads (the model's KV heads for `gqa`, one per query head for `mha`).
        """
        end = start + k.shape[2]
        if end > self.capacity:
            self._allocate(max(end, 2 * self.capacity))
            self._give_back()  # the copy now lives in buffers of its own
        if self.layout == "mha" and self.heads != k.shape[1]:
            groups = self.heads // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.quantized:
            self._store_fp8(self._k[layer], self._k_scale[layer], k, start, end)
            self._store_fp8(self._v[layer], self._v_scale[layer], v, start, end)
        else:
            self._k[layer].narrow(2, start, end - start).copy_(k)
            self._v[layer].narrow(2, start, end - start).copy_(v)
        self.lengths[layer] = end
        return self.read(layer, end)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` for positions [0, end) as `update` returns them, writing nothing."""
        if self.quantized:
            return (
                self._load_fp8(self._k[layer], self._k_scale[layer], end),
                self._load_fp8(self._v[layer], self._v_scale[layer], end),
            )
        keys, values = self._k[layer].narrow(2, 0, end), self._v[layer].narrow(2, 0, end)
        if self.storage_dtype != self.compute_dtype:  # e.g. a bfloat16 cache under a float32 model
            return keys.to(self.compute_dtype), values.to(self.compute_dtype)
        return keys, values

    @staticmethod
    def _store_fp8(buf: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, start: int, end: int):
        buf[:, :, start:end], scales[:, :, start:end] = quantize_fp8(x)

    def _load_fp8(self, buf: torch.Tensor, scales: torch.Tensor, end: int) -> torch.Tensor:
        return dequantize_fp8(buf[:, :, :end], scales[:, :, :end], self.compute_dtype)

    # -- taking K/V out and putting it back ---------------------------------------------------

    @property
    def valid_tokens(self) -> int:
        """Positions every layer holds: a pass that failed partway leaves later layers shorter."""
        return min(self.lengths) if self.lengths else 0

    def read_span(self, start: int, end: int) -> KVSpan:
        """Every layer's stored K/V for positions [start, end), copied out (see `KVSpan`)."""
        if not 0 <= start <= end <= self.valid_tokens:
            raise ValueError(f"positions [{start}, {end}) are not all held (every layer holds {self.valid_tokens})")

        def stack(buffers: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([b[0].narrow(1, start, end - start) for b in buffers])

        if self.quantized:
            return KVSpan(stack(self._k), stack(self._v), stack(self._k_scale), stack(self._v_scale))
        return KVSpan(stack(self._k), stack(self._v))

    def write_prefix(self, span: KVSpan) -> None:
        """Store `span` at positions [0, span.tokens) of every layer of this empty cache.

        The span must come from a cache of the same shape and storage (the prefix cache's hash
        makes sure of it); anything else is refused, never written.
        """
        n, tokens = self.cfg.num_hidden_layers, span.tokens
        want = (n, self.heads, tokens, self.cfg.head_dim)
        if tuple(span.keys.shape) != want or span.keys.dtype != self.storage_dtype:
            got = f"{tuple(span.keys.shape)} {span.keys.dtype}"
            raise ValueError(f"a K/V span of {got} does not fit this cache ({want} {self.storage_dtype})")
        if (span.key_scales is not None) != self.quantized:
            raise ValueError("a K/V span's FP8 scales do not match this cache's storage")
        if self.valid_tokens:
            raise ValueError("a prefix is written into an empty cache only")
        if tokens > self.capacity:
            self._allocate(tokens)
            self._give_back()
        for i in range(n):
            self._k[i][0, :, :tokens].copy_(span.keys[i])
            self._v[i][0, :, :tokens].copy_(span.values[i])
            if self.quantized:
                self._k_scale[i][0, :, :tokens].copy_(span.key_scales[i])
                self._v_scale[i][0, :, :tokens].copy_(span.value_scales[i])
        self.lengths = [tokens] * n

    # -- accounting --------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Positions held (the most any layer holds)."""
        return max(self.lengths) if self.lengths else 0

    def usage(self, lengths: tuple[int, ...] | None = None) -> KVUsage:
        """Bytes held now: logical (per token) and physical (whole blocks); with `lengths` (per
        layer, as the cache held them after a step), as of then."""
        lengths = tuple(self.lengths) if lengths is None else lengths
        cfg = self.cfg
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        per_token = kv_bytes_per_token(cfg.num_hidden_layers, self.heads, cfg.head_dim, elem)
        per_layer_token = per_token // cfg.num_hidden_layers
        scale_per_layer_token = 2 * self.heads * 4 if self.quantized else 0
        blocks = sum(blocks_for(n, self.block_size) for n in lengths)
        physical = blocks * self.block_size * (per_layer_token + scale_per_layer_token)
        reserved = self.capacity * cfg.num_hidden_layers * (per_layer_token + scale_per_layer_token)
        tokens = max(lengths) if lengths else 0
        layer_block_bytes = self.block_size * (per_layer_token + scale_per_layer_token)
        return KVUsage(
            layout=self.layout,
            dtype=str(self.storage_dtype).removeprefix("torch."),
            tokens=tokens,
            block_size=self.block_size,
            blocks=blocks_for(tokens, self.block_size),
            layers=cfg.num_hidden_layers,
            stored_heads=self.heads,
            head_dim=cfg.head_dim,
            bytes_per_token=per_token,
            logical_bytes=sum(per_layer_token * n for n in lengths),
            physical_bytes=physical,
            reserved_bytes=0 if not self._k else reserved,
            per_layer_tokens=lengths,
            per_layer_logical_bytes=tuple(per_layer_token * n for n in lengths),
            per_layer_physical_bytes=tuple(layer_block_bytes * blocks_for(n, self.block_size) for n in lengths),
        )

    def release(self) -> None:
        """Free the buffers (or give borrowed ones back); the cache is empty afterwards."""
        self._k, self._v, self._k_scale, self._v_scale = [], [], [], []
        self.lengths = [0] * self.cfg.num_hidden_layers
        self.capacity = 0
        self._give_back()

    def _give_back(self) -> None:
        if self.borrowed and self.on_release is not None:
            self.on_release()
        self.borrowed = False
        self.on_release = None
