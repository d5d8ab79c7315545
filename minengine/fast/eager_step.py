"""The eager single-token decode step, with as few operations per layer as the arithmetic allows.

A decode step streams every weight once, and between those reads runs a few dozen tiny
operations per layer. Each costs several microseconds, more than in a tight loop because the
weight stream has just evicted the interpreter and dispatcher from the caches (the figures:
docs/history.md, "The lean decode step, 2026-11-29"). So this step runs `Transformer.block` with
a `Scratch`: projections land in buffers whose views (q/k/v heads, gate and up) are made once, q
and k are rotated into a buffer, residuals are added in place; and its `Attention` copies K/V
straight into the cache's slot for the position and pins attention to one thread inline: about
35 operations per layer instead of 55.

Every arithmetic operation is the one `Transformer.forward` runs, on the same operands in the
same order, so the logits are bit for bit the same; only allocation and view-making are gone.
It serves caches that store K/V as computed (the model's dtype, grouped heads, room for the
position, one buffer per layer: a request's own, or a paged table whose blocks are consecutive);
`runner.ModelRunner` sends anything else down the general path.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable

import torch

from minengine.fast.attention_rows import RowsKernel, SlotKernel
from minengine.fast.cpu_kernels import library
from minengine.fast.panel_kernels import PanelLinear
from minengine.kv.block_pool import Segment
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
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
        stack = LayerStack.of(model) if attention.kernel is not None else None
        logits = None
        if stack is not None:  # every block in one C call, the same arithmetic on the same buffers
            logits = stack.step(x, cos, sin, attention.kernel, s)
        else:
            for i in range(len(model.layers)):
                x = model.block(i, x, cos, sin, attention, s)
        cache.note_written(pos + 1)
        return model.logits(x) if logits is None else logits

    def stack(self, cache: KVCache | PagedKVCache) -> LayerStack | None:
        """The C stack `step` runs every block through for `cache`, or None where it runs the
        Python block: the stack needs the model's shape (`LayerStack.serves`) and the slot
        kernel's cache layout (`SlotKernel.serves`)."""
        s = self._buffers()
        if not SlotKernel.serves(s.q, s.k, s.v, s.attended, cache.head_views()[0][0]):
            return None
        return LayerStack.of(self.model)

    def _buffers(self) -> Scratch:
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = Scratch.for_model(self.model)
        return s


_KINDS = {"float32": 0, "fp16": 1, "q8_0": 2, "q4_1": 3}  # decode_layers.c's enum
# The same products over the DOT8 copy, the rows rounded to int8 or int16 (`PanelLinear.rounding`).
_DOT8_KINDS = {("q8_0", "int8"): 4, ("q4_1", "int8"): 5, ("q8_0", "int16"): 6, ("q4_1", "int16"): 7}
_BUFFERS = ("h", "qkv", "rotated", "attended", "o", "gate_up", "gated", "down")  # StackArgs' scratch, in order


class Proj(ctypes.Structure):
    """decode_layers.c's Proj: one projection's panels."""

    _fields_ = [("kind", ctypes.c_long), ("inputs", ctypes.c_long), ("panels", ctypes.c_long),
                ("weights", ctypes.c_void_p)]  # fmt: skip

    @classmethod
    def of(cls, p: PanelLinear) -> Proj:
        if p.dot8 is not None:
            return cls(_DOT8_KINDS[p.format, p.rounding], p.in_features, p.panel_count, p.dot8.data_ptr())
        return cls(_KINDS[p.format], p.in_features, p.panel_count, p.panels.data_ptr())


class LayerArgs(ctypes.Structure):
    """decode_layers.c's LayerArgs: a block's weights, and its cache buffers for this step."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p)]  # fmt: skip


class StackArgs(ctypes.Structure):
    """decode_layers.c's StackArgs."""

    _fields_ = [("rows", ctypes.c_long), ("layers", ctypes.c_long), ("hidden", ctypes.c_long),
                ("heads", ctypes.c_long), ("d", ctypes.c_long), ("ff", ctypes.c_long),
                ("eps", ctypes.c_float), ("threads", ctypes.c_int), ("layer", ctypes.c_void_p), ("x", ctypes.c_void_p),
                *((name, ctypes.c_void_p) for name in _BUFFERS), ("xp", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("attend", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("head", Proj), ("logits", ctypes.c_void_p)]  # fmt: skip


class LayerStack:
    """Every block of a decode step in one call of `decode_layers.c`: the lean step's one row, or a
    shared step's decode rows attended together in the block pool.

    From Python a block is some 35 operations and ctypes calls of several microseconds each here
    (20-25% of a one-row step over fp16 panels); the C stack calls the same kernels the Python
    block calls (panels, `ops`' C norm, rotation and gating, the attention kernel) on buffers laid
    out as the Python block's, in the same order, so its residual stream is the Python block's bit
    for bit. It serves models whose blocks are that shape in panels on the CPU (`serves`); the
    weights' arguments are built once per model (`of`), and a step sets only its pointers.
    """

    _made: weakref.WeakKeyDictionary[Transformer, LayerStack | None] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: Transformer) -> LayerStack | None:
        """The model's stack, made on first use; None where `serves` says no."""
        if model not in cls._made:
            cls._made[model] = cls(model) if cls.serves(model) else None
        return cls._made[model]

    def __init__(self, model: Transformer) -> None:
        cfg = model.cfg
        self.layers = (LayerArgs * len(model.layers))()
        for args, layer in zip(self.layers, model.layers, strict=True):
            args.input_norm, args.post_norm = layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr()
            args.qkv, args.o = Proj.of(layer.qkv), Proj.of(layer.o)  # type: ignore[arg-type]
            args.gate_up, args.down = Proj.of(layer.gate_up), Proj.of(layer.down)  # type: ignore[arg-type]
        first = model.layers[0]
        self.hidden, self.d, self.ff = cfg.hidden_size, cfg.head_dim, first.down.in_features
        self.hq, self.heads = cfg.num_attention_heads, cfg.num_attention_heads + cfg.num_key_value_heads
        self.eps = first.input_norm.eps_value
        # A row's scratch widths, in decode_layers.c's order (`_BUFFERS`), then the repacking room.
        h, d = self.hidden, self.d
        self.widths = (h, first.qkv.out_features, self.heads * d, self.hq * d, h, 2 * self.ff, self.ff, h)
        self.widest = max(p.in_features for p in (first.qkv, first.o, first.gate_up, first.down))
        # The final norm and the head too, where the head reads a DOT8 copy: in the stack's one parallel
        # region (decode_layers.c), rather than a norm and a product of their own from Python.
        head = model.lm_head
        self.head: Proj | None = None
        dot8 = isinstance(head, PanelLinear) and head.dot8 is not None and head.out_features == head.panel_count * 8
        if dot8 and model.norm.eps_value == self.eps and model.norm.weight.dim() == 1:
            self.head, self.vocab = Proj.of(head), head.out_features
        self.final_norm = model.norm.weight.data_ptr()
        self._call = library().lib.decode_layers
        # A shared step's buffers, kept from step to step (only the model thread runs steps): a
        # row count's scratch, and the pool segment the layers' cache pointers point into.
        self._scratch: dict[int, torch.Tensor] = {}
        self._pointed: tuple[int, int, int, int] | None = None

    @staticmethod
    def serves(model: Transformer) -> bool:
        """Whether every block is the C stack's shape: float32 on the CPU, projections in panels
        whose outputs fill whole panels, no q/k/v bias or per-head norms, one norm epsilon."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or library().lib is None:
            return False
        eps = model.layers[0].input_norm.eps_value
        for layer in model.layers:
            projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(isinstance(p, PanelLinear) and p.out_features == p.panel_count * 8 for p in projections):
                return False
            norms = (layer.input_norm, layer.post_norm)
            if any(n.eps_value != eps or n.weight.dim() != 1 for n in norms):
                return False
            if layer.qkv_bias is not None or layer.qk_norm is not None:
                return False
        return True

    def _args(self, rows: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> StackArgs:
        return StackArgs(
            rows=rows, layers=len(self.layers), hidden=self.hidden, heads=self.heads, d=self.d, ff=self.ff,
            eps=self.eps, threads=torch.get_num_threads(), layer=ctypes.addressof(self.layers), x=x.data_ptr(),
            cos=cos.data_ptr(), sin=sin.data_ptr(), attend=ctypes.addressof(attend),
        )  # fmt: skip

    def _logits(self, a: StackArgs, rows: int) -> torch.Tensor | None:
        """The rows' logits [rows, vocab] the call will write, where the stack runs the head (`head`)."""
        if self.head is None:
            return None
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        a.final_norm, a.head, a.logits = self.final_norm, self.head, logits.data_ptr()
        return logits

    def step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: SlotKernel, s: Scratch
    ) -> torch.Tensor | None:
        """Every block on one row x [1, hidden] (added to in place) at the position `kernel`
        writes, in the scratch `s` the Python block would use; its logits [vocab] where the stack
        runs the head, else None (the caller runs it)."""
        a = self._args(1, x, cos, sin, kernel.args)
        logits = self._logits(a, 1)
        h = torch.empty(self.hidden, dtype=torch.float32)  # the normalised residual
        for name, t in zip(_BUFFERS, (h, s.qkv, s.rotated, s.attended, s.o, s.gate_up, s.gate, s.down), strict=True):
            setattr(a, name, t.data_ptr())  # gated in place over the gate, as the Python block does
        for args, kc, vc in zip(self.layers, kernel.keys, kernel.values, strict=True):
            args.kc, args.vc = kc, vc
        self._pointed = None  # the layers point into this request's own cache now
        self._call(ctypes.addressof(a))
        return None if logits is None else logits.view(-1)

    def rows(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kernel: RowsKernel,
        store: Segment,
        computing: Callable[[], object] | None = None,
    ) -> torch.Tensor | None:
        """Every block on the decode rows x [rows, hidden] (added to in place), attended by
        `kernel` in the pool segment `store`; cos/sin [rows, 1, d] contiguous. `computing` is
        called just before the C call. The rows' logits [rows, vocab] where the stack runs the
        head, else None (the caller runs it).

        What Python does here runs cold (the step before has streamed the weights through every
        cache) and, in a shared step, beside the threads of requests woken meanwhile, so pointing
        30 layers at the segment by indexing its tensors, and a fresh scratch, took about a
        millisecond of every 8-row step (docs/history.md, "The 2-core Zen 5 EPYC: unsteered
        decode, the attention kernel and the tiles"). So the layers' pointers change only with the
        segment and the scratch is kept per row count."""
        m = x.shape[0]
        a = self._args(m, x, cos, sin, kernel.args)
        scratch = self._scratch.get(m)
        if scratch is None:
            scratch = self._scratch[m] = torch.empty(m * (sum(self.widths) + self.widest), dtype=torch.float32)
        at = scratch.data_ptr()
        for name, width in zip(_BUFFERS, self.widths, strict=True):
            setattr(a, name, at)
            at += m * width * 4
        a.xp = at
        k, v = store.k, store.v  # [layers, KV heads, positions, d]
        attend = kernel.args
        attend.hq, attend.hkv, attend.d = self.hq, k.shape[1], self.d
        attend.q_at, attend.kc_hs, attend.vc_hs = kernel.query_ids(), k.stride(1), v.stride(1)
        pointed = (k.data_ptr(), v.data_ptr(), k.stride(0) * k.element_size(), v.stride(0) * v.element_size())
        if pointed != self._pointed:
            kp, vp, k_step, v_step = pointed
            for i, args in enumerate(self.layers):
                args.kc, args.vc = kp + i * k_step, vp + i * v_step
            self._pointed = pointed
        logits = self._logits(a, m)
        if computing is not None:
            computing()
        self._call(ctypes.addressof(a))
        return logits


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
