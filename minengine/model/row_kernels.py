"""RMSNorm, the rotary embedding and SiLU-gating over a step's rows in one C call each (`row_ops.c`).

`ops.RMSNorm`, `rope.rotate` and the MLP call these first on the CPU in float32 and keep torch's
operations wherever they answer None (another device or dtype, a layout they do not take, no
kernel built). Every CPU float32 path through the model (the lean decode step and its C stack
`decode_layers.c`, a shared step, a prompt) goes through them, so a row's norm and gating are
the same bits on each; the rotation is torch's bit for bit (`row_ops.c` says why).
"""

from __future__ import annotations

import torch

from minengine.model.cpu_kernels import library

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
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


def rotate(
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


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
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
