"""The small operations every block runs, in torch, and the set of them a model is built with.

A block calls its row operations (RMSNorm, the rotary embedding, SiLU-gating, the two
attentions) through the `ModelOps` it was built with: `TORCH_OPS` here, or the C ones of
`minengine.fast.row_ops`, chosen once when the model is built (`minengine.steps.load`), never
per call. Decode runs a few hundred of these per step, each costing more in dispatch than in
arithmetic, so each is written with as few dispatches as its arithmetic allows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-d tensor of `like`'s dtype and device, made once.

    No step creates one, which also keeps host-to-device copies out of a CUDA graph capture.
    """
    key = (value, like.dtype, like.device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return t


class Norm(Protocol):
    """An RMSNorm with its weight, as a block calls it (`ModelOps.norm` makes one)."""

    weight: torch.Tensor
    eps_value: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class RMSNorm:
    """RMSNorm with its weight: computed in float32, cast back, then scaled (Hugging Face's order).

    Bit for bit `x * rsqrt(x.pow(2).mean(-1) + eps)`: the mean is the same sum divided by
    the same count, written as one `addcdiv` (a third of the dispatches; `F.rms_norm` is a
    composite of more operations than this on the CPU). Activations come in the weight's dtype;
    in float32 the two casts are skipped, since they would return x itself yet cost a call
    each, and in a decode step every call costs microseconds. Its constants are made once,
    with the weight.
    """

    __slots__ = ("weight", "eps", "count", "wide", "eps_value")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.wide = weight.dtype == torch.float32
        like = torch.empty(0, dtype=torch.float32, device=weight.device)  # the statistics' dtype
        self.eps, self.count = constant(eps, like), constant(float(weight.shape[-1]), like)
        self.eps_value = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if self.wide else x.float()
        normed = xf * torch.addcdiv(self.eps, (xf * xf).sum(-1, keepdim=True), self.count).rsqrt_()
        return self.weight * (normed if self.wide else normed.to(x.dtype))


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's `apply_rotary` (`minengine.reference.model`) for x [T, heads, head_dim], with
    tables from `RotaryTable.lookup_signed`.

    rotate_half(x) * sin equals swap_halves(x) * signed_sin exactly (negation is exact), so the
    result is bit for bit Hugging Face's. (`addcmul` would save an operation but its fused
    multiply-add rounds differently.) A decode step passes `out` and `scratch` (both shaped
    like x): the same three operations then write into them instead of allocating.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)
    if out is None:
        return x * cos + swapped * signed_sin
    torch.mul(x, cos, out=out)
    return out.add_(torch.mul(swapped, signed_sin, out=scratch))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (into `out` when given, which may be gate itself)."""
    if out is None:
        return F.silu(gate).mul_(up)
    if out is gate:
        return F.silu(gate, inplace=True).mul_(up)
    return torch.mul(F.silu(gate), up, out=out)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query position over keys/values [Hkv, L, d]; returns [Hkv, Hq/Hkv, d] (into `out` when given).

    q is [Hq, d], or already grouped as [Hkv, Hq/Hkv, d]: the query heads sharing a KV head are
    stacked as rows of one small matrix, so grouped attention needs no repeated K/V. Every
    position is visible unless flagged in `hidden` [L] (the static decode step's fixed window);
    hidden slots get probability exactly 0. Callers run it on one thread (`threads.OneThread`).
    """
    if q.dim() == 2:
        q = q.view(keys.shape[0], -1, q.shape[-1])
    # beta=0 ignores the (dummy) input; the scale rides along as the GEMM's alpha.
    scores = torch.baddbmm(constant(0.0, q), q, keys.transpose(1, 2), beta=0, alpha=scale)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32)
    if probs.dtype != values.dtype:
        probs = probs.to(values.dtype)
    return torch.bmm(probs, values, out=out)


def padded_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query position per row: q [rows, Hq, d] over keys/values [rows, Hkv, L, d], whose
    positions `mask` [rows, 1, 1, L] flags as visible (None: all of them); returns [rows, Hkv, Hq/Hkv, d].

    The query heads sharing a KV head are stacked as that head's query positions (as
    `decode_attention` stacks them), so SDPA needs no repeated K/V nor its GQA option, on any
    backend; the mask has no causal part, so each of them sees every visible key.
    """
    rows, kv_heads = keys.shape[0], keys.shape[1]
    grouped = q.reshape(rows, kv_heads, -1, q.shape[-1])
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)


def _offset_mask(start: int, T: int, device: torch.device) -> torch.Tensor | None:
    """Query i of a chunk at `start` sees keys up to start + i; None for a chunk from position 0 (causal)."""
    if start == 0:
        return None
    rows = torch.arange(T, device=device).unsqueeze(1) + start
    return torch.arange(start + T, device=device).unsqueeze(0) <= rows


def _prompt_attention_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    mask = _offset_mask(start, q.shape[2], q.device)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)


def _prompt_attention_repeated(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    mask = _offset_mask(start, q.shape[2], q.device)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # a transient expansion, where this torch's SDPA has no GQA option
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


# Causal attention of q [1, Hq, T, d] over cached k/v [1, Hkv, start+T, d]: [1, Hq, T, d]. K/V are never
# repeated into the cache: SDPA's native GQA reads them as they are, on a torch that has it (chosen here,
# once). A single query position is cheaper through `decode_attention`.
prompt_attention = (
    _prompt_attention_gqa
    if "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
    else _prompt_attention_repeated
)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, d] -> [1, heads, T, d] (a view), the cache's order."""
    return x.transpose(0, 1).unsqueeze(0)


@dataclass(frozen=True)
class ModelOps:
    """The implementations of a block's row operations, bound once when the model is built.

    Each has torch's signature above: `norm(weight, eps)` makes a `Norm`; `rotate`, `silu_mul` and
    `decode_attention` write into `out` when given; `prompt_attention(q, k, v, start, scale)`.
    """

    name: str  # "torch" or "C": what the settings report and a step's `why` name
    why: str  # why this set, on this machine and model
    norm: Callable[[torch.Tensor, float], Norm]
    rotate: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    prompt_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


TORCH_OPS = ModelOps(
    "torch", "torch's operations", RMSNorm, rotate, silu_mul, decode_attention, prompt_attention
)
