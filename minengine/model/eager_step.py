"""The eager single-token decode step, with as few operations per layer as the arithmetic allows.

A decode step streams every weight once, and between those reads runs a few dozen tiny
operations per layer. Each costs several microseconds, more than in a tight loop because the
weight stream has just evicted the interpreter and dispatcher from the caches (measured: 50 us
for the six operations of one RMSNorm, 12 ms of a 50 ms step outside the projections). So this
step writes projections into scratch buffers whose views (q/k/v heads, gate and up) are made
once, rotates q and k into a buffer, copies K/V straight into the cache's slot for the
position, and adds residuals in place: about 35 operations per layer instead of 55.

Every arithmetic operation is the one `Transformer.forward` runs, on the same operands in the
same order, so the logits are bit for bit the same; only allocation and view-making are gone.
It serves caches that store K/V as computed (the model's dtype, grouped heads, room for the
position); anything else takes the general path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minengine.kv.cache import KVCache

if TYPE_CHECKING:
    from minengine.model.transformer import Transformer


@dataclass
class Scratch:
    """One thread's step buffers, and the fixed views into them (`_out` shapes: [chunks, 1, n/chunks])."""

    qkv: torch.Tensor  # the fused projection's output, chunks end to end
    qk: torch.Tensor  # [1, Hq+Hkv, d] view of q and k in `qkv`
    v: torch.Tensor  # [Hkv, d] view of v in `qkv`
    rotated: torch.Tensor  # [1, Hq+Hkv, d]
    swapped_term: torch.Tensor  # [1, Hq+Hkv, d]
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


def _scratch(model: Transformer) -> Scratch:
    cfg, layer = model.cfg, model.layers[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def out(operand: torch.Tensor) -> torch.Tensor:
        return torch.empty(operand.shape[0], 1, operand.shape[2], dtype=model.dtype, device=model.device)

    qkv, o, gate_up, down = out(layer.qkv), out(layer.o), out(layer.gate_up), out(layer.down)
    flat = qkv.view(1, -1)
    qk = flat[:, : (hq + hkv) * d].view(1, hq + hkv, d)
    rotated = torch.empty_like(qk)
    attended = torch.empty(hkv, hq // hkv, d, dtype=model.dtype, device=model.device)
    return Scratch(
        qkv=qkv,
        qk=qk,
        v=flat[0, (hq + hkv) * d :].view(hkv, d),
        rotated=rotated,
        swapped_term=torch.empty_like(qk),
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


class EagerDecoder:
    """Runs `Transformer.forward` for one token when the cache allows the lean path."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._local = threading.local()  # a server decodes several requests on their own threads

    def serves(self, cache: KVCache, pos: int) -> bool:
        """Whether the lean step can write position `pos` into `cache`."""
        return (
            not cache.quantized
            and cache.storage_dtype == self.model.dtype
            and cache.heads == self.model.cfg.num_key_value_heads
            and pos < cache.capacity
            and not cache.borrowed
        )

    def step(self, ids: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """Logits [vocab] (float32) for the token `ids` [1] at `pos`; writes its K/V into `cache`."""
        from minengine.model.transformer import _constant, rms_norm  # model imports this module

        model, s = self.model, self._buffers()
        eps, scale, end = model.cfg.rms_norm_eps, model.scale, pos + 1
        cos, sin = model.rope.lookup_signed(pos, 1)
        keys, values = cache.head_views()
        # Attention runs on one thread (see `threads.OneThread`), set inline: this loop is hot.
        threads = torch.get_num_threads() if model.device.type == "cpu" else 1
        x = model.embed_tokens(ids)  # [1, hidden], a fresh tensor: residuals are added in place
        zero, half = _constant(0.0, x), model.cfg.head_dim // 2
        norm = rms_norm
        if x.dtype == torch.float32:  # rms_norm's casts are no-ops: skip their calls
            eps_t, count_t = _constant(eps, x), _constant(float(x.shape[-1]), x)

            def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
                return weight * (x * torch.addcdiv(eps_t, (x * x).sum(-1, keepdim=True), count_t).rsqrt_())

        for i, layer in enumerate(model.layers):
            h = norm(x, layer.input_norm, eps)
            if layer.qkv_bias is None:
                torch.bmm(h.expand(s.qkv.shape[0], 1, -1), layer.qkv, out=s.qkv)
            else:
                _project(h, layer.qkv, s.qkv, layer.qkv_bias)
            qk = s.qk if layer.qk_norm is None else rms_norm(s.qk, layer.qk_norm, eps)
            torch.mul(qk, cos, out=s.rotated)
            torch.mul(qk.roll(half, dims=-1), sin, out=s.swapped_term)
            s.rotated.add_(s.swapped_term)
            keys[i].select(1, pos).copy_(s.k)
            values[i].select(1, pos).copy_(s.v)
            # `decode_attention`'s operations, into the scratch buffer.
            if threads > 1:
                torch.set_num_threads(1)
            scores = torch.baddbmm(zero, s.q, keys[i].narrow(1, 0, end).transpose(1, 2), beta=0, alpha=scale)
            probs = scores.softmax(dim=-1, dtype=torch.float32)
            if probs.dtype != x.dtype:
                probs = probs.to(x.dtype)
            torch.bmm(probs, values[i].narrow(1, 0, end), out=s.attended)
            if threads > 1:
                torch.set_num_threads(threads)
            torch.bmm(s.attended_row.expand(s.o.shape[0], 1, -1), layer.o, out=s.o)
            x.add_(s.o_row)
            torch.bmm(norm(x, layer.post_norm, eps).expand(2, 1, -1), layer.gate_up, out=s.gate_up)
            F.silu(s.gate, inplace=True).mul_(s.up)
            torch.bmm(s.gate.expand(s.down.shape[0], 1, -1), layer.down, out=s.down)
            x.add_(s.down_row)
        cache.note_written(end)
        logits = torch.bmm(norm(x, model.norm, eps).expand(model.lm_head.shape[0], 1, -1), model.lm_head)
        return logits.view(-1).float()

    def _buffers(self) -> Scratch:
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = _scratch(self.model)
        return s


def _project(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None):
    """`weight_layout.project_chunks` for one row, into `out` [chunks, 1, out/chunks]."""
    rows = x.expand(weight.shape[0], *x.shape)
    if bias is None:
        return torch.bmm(rows, weight, out=out)
    return torch.baddbmm(bias.view(weight.shape[0], 1, -1), rows, weight, out=out)
