"""The small operations every path through the model shares: RMSNorm and the two attentions.

Decode runs a few hundred of these per step, each costing more in dispatch than in
arithmetic, so each is written with as few dispatches as its arithmetic allows, and takes an
`out` buffer where a decode step keeps one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minengine.model import row_kernels
from minengine.model.attention_rows import attend_one, serves

_HAS_GQA_SDPA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

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


class RMSNorm:
    """RMSNorm with its weight: computed in float32, cast back, then scaled (Hugging Face's order).

    Bit for bit `x * rsqrt(x.pow(2).mean(-1) + eps)`: the mean is the same sum divided by
    the same count, written as one `addcdiv` (a third of the dispatches; `F.rms_norm` is a
    composite of more operations than this on the CPU). Activations come in the weight's dtype;
    in float32 the two casts are skipped, since they would return x itself yet cost a call
    each, and in a decode step every call costs microseconds (`eager_step`). Its constants are
    made once, with the weight. On the CPU in float32 it is one C call instead
    (`row_kernels.rms_norm`: the same formula, the sum of squares in another order).
    """

    __slots__ = ("weight", "eps", "count", "wide", "eps_value")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.wide = weight.dtype == torch.float32
        like = torch.empty(0, dtype=torch.float32, device=weight.device)  # the statistics' dtype
        self.eps, self.count = constant(eps, like), constant(float(weight.shape[-1]), like)
        self.eps_value = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide:
            y = row_kernels.rms_norm(x, self.weight, self.eps_value)
            if y is not None:
                return y
        xf = x if self.wide else x.float()
        normed = xf * torch.addcdiv(self.eps, (xf * xf).sum(-1, keepdim=True), self.count).rsqrt_()
        return self.weight * (normed if self.wide else normed.to(x.dtype))


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query position over keys/values [Hkv, L, d]; returns [Hkv, Hq/Hkv, d] (into `out` when given).

    q is [Hq, d], or already grouped as [Hkv, Hq/Hkv, d]: the query heads sharing a KV head are
    stacked as rows of one small matrix, so grouped attention needs no repeated K/V. Every
    position is visible unless flagged in `hidden` [L] (the static decode step's fixed window);
    hidden slots get probability exactly 0. Callers run it on one thread (`threads.OneThread`).
    """
    if hidden is None and serves(q, keys, values) and (out is None or out.is_contiguous()):
        return attend_one(q, keys, values, scale, out)  # read in place, a dozen dispatches fewer
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of q [1, Hq, T, d] over cached k/v [1, Hkv, start+T, d]; returns [1, Hq, T, d].

    K/V are never repeated into the cache: SDPA's native GQA reads them as they are (a
    transient expansion stands in on torch builds without it). A single query position is
    cheaper through `decode_attention`.
    """
    hq, hkv, T = q.shape[1], k.shape[1], q.shape[2]
    groups = hq // hkv
    mask = None
    causal = start == 0
    if not causal:  # a chunk after cached context: query i sees keys up to start + i
        rows = torch.arange(T, device=q.device).unsqueeze(1) + start
        mask = torch.arange(start + T, device=q.device).unsqueeze(0) <= rows
    if groups > 1:
        if _HAS_GQA_SDPA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, d] -> [1, heads, T, d] (a view), the cache's order."""
    return x.transpose(0, 1).unsqueeze(0)
