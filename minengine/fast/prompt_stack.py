"""One sequence's prompt chunk through every block in one C call (`prompt_layers.c`).

A chunk through the Python blocks (`Transformer.forward`) is a dozen calls a layer, each opening its own
OpenMP region and leaving the second thread waiting while Python walks to the next: a fixed cost a layer,
most of a short chat prompt's prefill beside its arithmetic (docs/performance.md gives the figures).
`prompt_layers.c` runs the whole chunk in one region: the same kernels on the same values in
the same order, so its logits and the K/V it leaves in the cache are the Python blocks' bit for bit, and a
prompt's first token does not depend on which of the two ran it.

It serves the models `LayerStack` serves whose projections all read a DOT8 copy (int16 or int8 rows,
`dot8_rows.c`), whose gate/up product gates its own sums and whose prompt attention is the key-blocked
chunk kernel (`row_ops.model_ops`); and caches that hold K/V as computed, in one run (`serves`). The
step's plan (`ModelRunner.pick`) decides when it runs.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from minengine.fast import chunk_attention
from minengine.fast.cpu_kernels import library
from minengine.fast.eager_step import LayerStack, layer_args
from minengine.fast.panel_kernels import PanelLinear
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.transformer import Transformer

_BUFFERS = ("h", "qkv", "rotated", "attended", "o", "down")  # PromptArgs' scratch, in order


class PromptArgs(ctypes.Structure):
    """prompt_layers.c's PromptArgs, field for field."""

    _fields_ = [("rows", ctypes.c_long), ("start", ctypes.c_long),
                *((name, ctypes.c_long) for name in ("layers", "hidden", "hq", "hkv", "d", "ff")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("threads", ctypes.c_int), ("rounded", ctypes.c_int),
                ("layer", ctypes.c_void_p), ("kc_hs", ctypes.c_long), ("vc_hs", ctypes.c_long), ("x", ctypes.c_void_p),
                *((name, ctypes.c_void_p) for name in _BUFFERS),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]  # fmt: skip


class PromptStack:
    """Every block of one sequence's prompt chunk in one call of `prompt_layers.c`; the weights' arguments
    are built once per model (`of`), a chunk sets its pointers."""

    _made: weakref.WeakKeyDictionary[Transformer, PromptStack | None] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: Transformer) -> PromptStack | None:
        """The model's prompt stack, made on first use; None where `serves_model` says no."""
        if model not in cls._made:
            cls._made[model] = cls(model) if cls.serves_model(model) else None
        return cls._made[model]

    @staticmethod
    def serves_model(model: Transformer) -> bool:
        """Whether the stack computes what the Python blocks compute for this model: `LayerStack`'s block
        shape, every projection over a DOT8 copy with the gate/up product gating its own sums, and the chunk
        kernel as the prompt's attention."""
        if not LayerStack.serves(model):
            return False
        if model.ops.prompt_attention not in chunk_attention.KEYBLOCKED:
            return False
        for layer in model.layers:
            projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(isinstance(p, PanelLinear) and p.dot8 is not None for p in projections):
                return False
            if not layer.gating_in_product:
                return False
        return True

    def __init__(self, model: Transformer) -> None:
        cfg, first = model.cfg, model.layers[0]
        self.model = model
        self.layers = layer_args(model)
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden, self.ff = cfg.hidden_size, first.down.in_features
        self.eps, self.scale = first.input_norm.eps_value, model.scale
        self.rounded = model.ops.prompt_attention is chunk_attention.attend_chunk_rounded
        h, d = self.hidden, self.d
        # A position's scratch widths, in `_BUFFERS`' order.
        self.widths = (h, first.qkv.out_features, (self.hq + self.hkv) * d, self.hq * d, h, h)
        self._call = library().lib.prompt_layers

    def refusal(self, cache: KVCache | PagedKVCache, start: int, length: int) -> str | None:
        """Why the chunk [start, start + length) cannot run here over `cache`, None where it can: two positions
        or more (one is a decode step's), and a cache that holds K/V as computed in one run of buffers with
        room for them, a head's positions d apart (as `EagerDecoder.serves` asks of a decode step's)."""
        if length < 2:
            return "one position"
        if cache.quantized or cache.storage_dtype != torch.float32:
            return f"the cache stores K/V as {str(cache.storage_dtype).removeprefix('torch.')}"
        if cache.heads != self.hkv:
            return f"the cache holds {cache.heads} heads (the {cache.layout} layout), the model {self.hkv}"
        if cache.borrowed or not cache.contiguous:
            return "the cache's blocks are not one run" if not cache.borrowed else "the cache is borrowed"
        if start + length > cache.capacity:
            return "the cache must grow for the chunk"
        keys, values = cache.head_views()
        if not all(t.stride(-1) == 1 and t.stride(-2) == self.d for t in (keys[0], values[0])):
            return "the cache's positions are not a head's d floats apart"
        return None

    def run(
        self, ids: torch.Tensor, start: int, cache: KVCache | PagedKVCache, *, logits: bool = True
    ) -> torch.Tensor | None:
        """Logits [vocab] (float32) of the chunk's last position, for the tokens `ids` [T] at positions
        [start, start + T) of `cache` (`refusal` None), whose K/V it writes in every layer; None without
        `logits` (a chunk that does not end its prompt: the head is not run)."""
        model, length = self.model, ids.shape[0]
        x = model.embed_tokens(ids)  # [T, hidden], a fresh tensor: residuals are added in place
        cos, sin = model.rope.lookup_signed(start, length)
        cos, sin = cos.contiguous(), sin.contiguous()
        keys, values = cache.head_views()
        for args, k, v in zip(self.layers, keys, values, strict=True):
            args.kc, args.vc = k.data_ptr(), v.data_ptr()
        scratch = torch.empty(length * sum(self.widths), dtype=torch.float32)
        a = PromptArgs(
            rows=length, start=start, layers=len(self.layers), hidden=self.hidden, hq=self.hq, hkv=self.hkv,
            d=self.d, ff=self.ff, eps=self.eps, scale=self.scale, threads=torch.get_num_threads(),
            rounded=int(self.rounded), layer=ctypes.addressof(self.layers), kc_hs=keys[0].stride(0),
            vc_hs=values[0].stride(0), x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
        )  # fmt: skip
        at = scratch.data_ptr()
        for name, width in zip(_BUFFERS, self.widths, strict=True):
            setattr(a, name, at)
            at += length * width * 4
        status = self._call(ctypes.addressof(a))
        if status == 1:
            raise ValueError(f"the rounded chunk attention does not take heads of {self.d} floats on this build")
        if status:
            raise MemoryError("no memory for the prompt's rounded rows or keys")
        cache.note_written(start + length)
        return model.logits(x[-1:]) if logits else None
