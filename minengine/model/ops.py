"""The small operations every path through the model shares: RMSNorm, the two attentions, and
the C calls that stand in for a block's row operations on the CPU.

Decode runs a few hundred of these per step, each costing more in dispatch than in
arithmetic, so each is written with as few dispatches as its arithmetic allows, and takes an
`out` buffer where a decode step keeps one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minengine.fast.attention_rows import attend_one, attend_prompt, serves
from minengine.fast.cpu_kernels import library
from minengine.fast.panel_kernels import activations

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
    (`c_rms_norm`: the same formula, the sum of squares in another order).
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
            y = c_rms_norm(x, self.weight, self.eps_value)
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
    if activations() == "int8" and serves(q, k[0], v[0]):
        # int8 activations round each row: a last-bit difference from SDPA cutting the prompt another way
        # (alone, or in a batch's chunks) would flip roundings and part the tokens, so each position
        # attends as a row of its own, the same bits however the prompt was chunked.
        return attend_prompt(q, k, v, start, scale)
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


# -- RMSNorm, the rotation and SiLU-gating in one C call each (`row_ops.c`) ------------------------
# `RMSNorm`, `rope.rotate` and the MLP call these first on the CPU in float32 and keep torch's
# operations wherever they answer None (another device or dtype, a layout they do not take, no
# kernel built). Every CPU float32 path through the model (the lean decode step and its C stack
# `decode_layers.c`, a shared step, a prompt) goes through them, so a row's norm and gating are
# the same bits on each; the rotation is torch's bit for bit (`row_ops.c` says why).

_F32 = torch.float32


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(T, H, stride of T, stride of H) of a [T, d] or [T, H, d] tensor whose last dim is contiguous."""
    if t.stride(-1) != 1:
        return None
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    return None


def _serves(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Written out rather than over a generator: this runs a few times per layer of every step.
    return a.dtype == _F32 and b.dtype == _F32 and a.is_cpu and b.is_cpu and library().lib is not None


def c_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * (x * rsqrt(eps + mean(x^2)))` over x's last dim (weight [d]), a new contiguous
    tensor; None where the kernel does not serve them."""
    if weight.dim() != 1 or not _serves(x, weight) or not weight.is_contiguous():
        return None  # a weight row per head (qwen3's q/k norms) stays torch's, on every path alike
    shape = _rows(x)
    if shape is None:
        return None
    T, H, st, sh = shape
    d = x.shape[-1]
    y = torch.empty(x.shape, dtype=_F32)
    library().lib.rms_norm_rows(x.data_ptr(), T, H, d, st, sh, weight.data_ptr(), eps, y.data_ptr(), H * d, d)
    return y


def c_rotate(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor | None:
    """`rope.rotate` of x [T, heads, d] (into `out` when given, which must not overlap x); None
    where the kernel does not serve them."""
    if x.dim() != 3 or not _serves(x, cos) or signed_sin.dtype != _F32:
        return None
    T, H, d = x.shape
    tables = all(t.stride(-1) == 1 and (T == 1 or t.stride(0) == d) and t.shape[0] == T for t in (cos, signed_sin))
    shape = _rows(x)
    y = torch.empty(x.shape, dtype=_F32) if out is None else out
    into = _rows(y)
    if shape is None or into is None or not tables or y.dtype != _F32:
        return None
    library().lib.rope_rows(
        x.data_ptr(), T, H, d, shape[2], shape[3], cos.data_ptr(), signed_sin.data_ptr(), y.data_ptr(), into[2], into[3]
    )
    return y


def c_silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up for [T, n] rows (into `out` when given, which may be gate); None where the
    kernel does not serve them."""
    if gate.dim() != 2 or not _serves(gate, up) or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return None
    y = torch.empty(gate.shape, dtype=_F32) if out is None else out
    if y.stride(-1) != 1 or y.shape != gate.shape:
        return None
    T, n = gate.shape
    strides = gate.stride(0), up.stride(0), y.stride(0)
    library().lib.silu_mul_rows(gate.data_ptr(), up.data_ptr(), y.data_ptr(), T, n, *strides)
    return y
