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
from dataclasses import dataclass

import torch

from minengine.checkpoint.weight_layout import Operand, product
from minengine.fast.attention_rows import RowsKernel, SlotKernel
from minengine.fast.cpu_kernels import library
from minengine.fast.panel_kernels import PanelLinear
from minengine.kv.block_pool import Segment
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.model.ops import decode_attention
from minengine.model.transformer import Layer, Transformer
from minengine.threads import OneThread


@dataclass
class Scratch:
    """Buffers one token's pass through a block writes into, and the fixed views into them.

    A decode step that writes into these (`EagerDecoder`) allocates nothing and makes no view:
    every product lands in a buffer whose views (q/k/v heads, gate and up, rows) were made once
    (`eager_step` says what that saves). Projection buffers are [chunks, 1, n/chunks], the
    layout `Product.chunks` writes. One set serves every layer; a thread needs its own.
    """

    qkv: torch.Tensor  # the fused projection's output, chunks end to end
    qk: torch.Tensor  # [1, Hq+Hkv, d] view of q and k in `qkv`
    v: torch.Tensor  # [Hkv, d] view of v in `qkv`
    rotated: torch.Tensor  # [1, Hq+Hkv, d]
    swapped: torch.Tensor  # [1, Hq+Hkv, d], rotation's second term
    q: torch.Tensor  # [Hkv, Hq/Hkv, d] view of `rotated`: the query heads of each KV head as rows
    k: torch.Tensor  # [Hkv, d] view of `rotated`
    attended: torch.Tensor  # [Hkv, Hq/Hkv, d]
    attended_row: torch.Tensor  # [1, Hq*d] view of `attended`
    o: torch.Tensor
    o_row: torch.Tensor  # [1, hidden] view of `o`
    gate_up: torch.Tensor  # [2, 1, ff]: gate, then up
    gate: torch.Tensor  # [1, ff] views of `gate_up`
    up: torch.Tensor
    down: torch.Tensor
    down_row: torch.Tensor  # [1, hidden] view of `down`

    @classmethod
    def for_model(cls, model: Transformer) -> Scratch:
        """A fresh set shaped for `model`'s blocks."""
        cfg, layer = model.cfg, model.layers[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        def out(operand: torch.Tensor) -> torch.Tensor:
            return torch.empty(operand.shape[0], 1, operand.shape[2], dtype=model.dtype, device=model.device)

        qkv, o, gate_up, down = out(layer.qkv), out(layer.o), out(layer.gate_up), out(layer.down)
        flat = qkv.view(1, -1)
        qk = flat[:, : (hq + hkv) * d].view(1, hq + hkv, d)
        rotated = torch.empty_like(qk)
        attended = torch.empty(hkv, hq // hkv, d, dtype=model.dtype, device=model.device)
        return cls(
            qkv=qkv,
            qk=qk,
            v=flat[0, (hq + hkv) * d :].view(hkv, d),
            rotated=rotated,
            swapped=torch.empty_like(qk),
            q=rotated[0, :hq].view(hkv, hq // hkv, d),
            k=rotated[0, hq:],
            attended=attended,
            attended_row=attended.view(1, hq * d),
            o=o,
            o_row=o.view(1, -1),
            gate_up=gate_up,
            gate=gate_up[0],
            up=gate_up[1],
            down=down,
            down_row=down.view(1, -1),
        )


Write = Callable[[torch.Tensor, torch.Tensor], object]  # a one-row product into its scratch buffer


def writer(weight: Operand, bias: torch.Tensor | None = None) -> Write:
    """How one row's product with `weight` lands in a scratch buffer [chunks, 1, out/chunks], chosen
    once per projection: a panel kernel writes its row straight in (one row's chunks lie end to end);
    any other operand through its product's chunks (`weight_layout.product`)."""
    if bias is None and isinstance(weight, PanelLinear):
        return lambda x, out: weight.linear(x, out=out.view(1, -1))
    return product(weight, bias).chunks


class LayerWriters:
    """A block's four projections, each as a `writer`."""

    __slots__ = ("qkv", "o", "gate_up", "down")

    def __init__(self, layer: Layer) -> None:
        self.qkv, self.o = writer(layer.qkv, layer.qkv_bias), writer(layer.o)
        self.gate_up, self.down = writer(layer.gate_up), writer(layer.down)


class EagerDecoder:
    """One-token steps into scratch buffers, for caches that allow them: every block in one C call
    (`step_stack`), or `Transformer.block`'s arithmetic from Python into the scratch (`step_blocks`)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._local = threading.local()  # a server decodes several requests on their own threads
        self._writers = [LayerWriters(layer) for layer in model.layers]

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

    def slot_kernel_serves(self, cache: KVCache | PagedKVCache) -> bool:
        """Whether the C slot kernel writes and attends this cache's slots (`SlotKernel.serves`)."""
        s = self._buffers()
        return SlotKernel.serves(s.q, s.k, s.v, s.attended, cache.head_views()[0][0])

    def step_stack(self, ids: torch.Tensor, pos: int, cache: KVCache | PagedKVCache, stack: LayerStack) -> torch.Tensor:
        """Logits [vocab] (float32) for the token `ids` [1] at `pos` through every block in one C call;
        writes its K/V into `cache`."""
        model, s = self.model, self._buffers()
        cos, sin = model.rope.lookup_signed(pos, 1)
        keys, values = cache.head_views()
        kernel = SlotKernel(keys, values, pos, (s.q, s.k, s.v, s.attended), model.scale)
        x = model.embed_tokens(ids)  # [1, hidden], a fresh tensor: residuals are added in place
        logits = stack.step(x, cos, sin, kernel, s)
        cache.note_written(pos + 1)
        return model.logits(x) if logits is None else logits

    def step_blocks(
        self, ids: torch.Tensor, pos: int, cache: KVCache | PagedKVCache, *, slot_kernel: bool
    ) -> torch.Tensor:
        """Logits [vocab] (float32) for the token `ids` [1] at `pos`, block by block from Python into the
        scratch buffers, attending through the C slot kernel (`slot_kernel`) or torch's operations."""
        model, s = self.model, self._buffers()
        cos, sin = model.rope.lookup_signed(pos, 1)
        attention = (SlotKernelAttention if slot_kernel else SlotAttention)(cache, pos, s, model.scale)
        x = model.embed_tokens(ids)
        for i in range(len(model.layers)):
            x = self._block(i, x, cos, sin, attention, s)
        cache.note_written(pos + 1)
        return model.logits(x)

    def _block(self, index: int, x: torch.Tensor, cos, sin, attention, s: Scratch) -> torch.Tensor:
        """`Transformer.block` on one row, every product and the rotation into `s`: the same
        operations on the same operands in the same order, so the same bits."""
        model, layer, w = self.model, self.model.layers[index], self._writers[index]
        w.qkv(layer.input_norm(x), s.qkv)
        qk = s.qk if layer.qk_norm is None else layer.qk_norm(s.qk)
        model.ops.rotate(qk, cos, sin, out=s.rotated, scratch=s.swapped)
        w.o(attention(index, s.q, s.k, s.v), s.o)
        x.add_(s.o_row)
        w.gate_up(layer.post_norm(x), s.gate_up)
        model.ops.silu_mul(s.gate, s.up, out=s.gate)
        w.down(s.gate, s.down)
        return x.add_(s.down_row)

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


def layer_args(model: Transformer) -> ctypes.Array:
    """Every block's `LayerArgs` for a C stack (decode_layers.c, prompt_layers.c): its norms' weights and its
    projections' panels; the cache pointers are set per step."""
    layers = (LayerArgs * len(model.layers))()
    for args, layer in zip(layers, model.layers, strict=True):
        args.input_norm, args.post_norm = layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr()
        args.qkv, args.o = Proj.of(layer.qkv), Proj.of(layer.o)  # type: ignore[arg-type]
        args.gate_up, args.down = Proj.of(layer.gate_up), Proj.of(layer.down)  # type: ignore[arg-type]
    return layers


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
        self.layers = layer_args(model)
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
    """`Attention` for one position of an unborrowed, unquantized grouped-heads cache, in torch's
    operations: K/V copied straight into the slot for `pos` through the cache's per-layer views
    (`KVCache.head_views`, made once), then one query's attention into the scratch buffer, on one
    thread (see `threads.OneThread`)."""

    __slots__ = ("keys", "values", "pos", "end", "out", "row", "scale")

    def __init__(self, cache: KVCache | PagedKVCache, pos: int, s: Scratch, scale: float) -> None:
        self.keys, self.values = cache.head_views()
        self.pos, self.end = pos, pos + 1
        self.out, self.row = s.attended, s.attended_row
        self.scale = scale

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.keys[index], self.values[index]
        keys.select(1, self.pos).copy_(k)
        values.select(1, self.pos).copy_(v)
        with OneThread(q.device):
            decode_attention(q, keys.narrow(1, 0, self.end), values.narrow(1, 0, self.end), self.scale, self.out)
        return self.row


class SlotKernelAttention:
    """`SlotAttention` in one call of the C kernel per layer (`attention_rows.SlotKernel`): the slot
    written and the query attended, the arithmetic `ops.decode_attention` runs, for float32 on the CPU."""

    __slots__ = ("kernel", "row")

    def __init__(self, cache: KVCache | PagedKVCache, pos: int, s: Scratch, scale: float) -> None:
        keys, values = cache.head_views()
        self.kernel = SlotKernel(keys, values, pos, (s.q, s.k, s.v, s.attended), scale)
        self.row = s.attended_row

    def __call__(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kernel(index)  # q, k, v are the scratch buffers the kernel was given
        return self.row
