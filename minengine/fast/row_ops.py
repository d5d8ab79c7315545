"""The model's row operations in C: RMSNorm, the rotary embedding and SiLU-gating (`row_ops.c`) and
the two attentions (`attention_rows.c`), bound in place of torch's when the model is built
(`model_ops`), for float32 on the CPU.

Every CPU float32 path through the model (the lean decode step and its C stack
`decode_layers.c`, a shared step, a prompt) goes through them, so a row's norm and gating are
the same bits on each; the rotation is torch's bit for bit (`row_ops.c` says why). Each takes
torch's signature (`minengine.model.ops`) and the layouts the model hands it (a row's last dim
contiguous); another layout is a mistake of the caller's, refused rather than run slowly.
"""

from __future__ import annotations

import torch

from minengine import settings
from minengine.fast import attention_rows, chunk_attention
from minengine.fast.attention_rows import attend_one, serves
from minengine.fast.cpu_kernels import library
from minengine.model.ops import TORCH_OPS, ModelOps, Norm, RMSNorm
from minengine.settings import SettingValue

_F32 = torch.float32


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(T, H, stride of T, stride of H) of a [T, d] or [T, H, d] tensor whose last dim is contiguous."""
    if t.stride(-1) == 1 and t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.stride(-1) == 1 and t.dim() == 3:
        return t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"the C row operations take [T, d] or [T, H, d] rows with a contiguous last dim, not {t.shape}")


class CNorm:
    """`RMSNorm` in one C call: `weight * (x * rsqrt(eps + mean(x^2)))` over x's last dim, into a
    new contiguous tensor (the same formula as torch's, the sum of squares in another order)."""

    __slots__ = ("weight", "eps_value")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps_value = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        T, H, st, sh = _rows(x)
        d = x.shape[-1]
        y = torch.empty(x.shape, dtype=_F32)
        library().lib.rms_norm_rows(x.data_ptr(), T, H, d, st, sh, self.weight.data_ptr(), self.eps_value,
                                    y.data_ptr(), H * d, d, torch.get_num_threads())  # fmt: skip
        return y


def c_norm(weight: torch.Tensor, eps: float) -> Norm:
    """A norm for `weight`: C's for one weight row, torch's for a row per head (qwen3's q/k norms,
    which every path then runs alike)."""
    if weight.dim() == 1 and weight.is_contiguous():
        return CNorm(weight, eps)
    return RMSNorm(weight, eps)


def c_rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ops.rotate` of x [T, heads, d] in one C call (into `out` when given, which must not overlap
    x; `scratch` is torch's and unused here)."""
    T, H, d = x.shape
    if not all(t.stride(-1) == 1 and (T == 1 or t.stride(0) == d) and t.shape[0] == T for t in (cos, signed_sin)):
        raise ValueError("the C rotation takes the rotary table's rows, [T, 1, d] with rows d apart")
    _, _, st, sh = _rows(x)
    y = torch.empty(x.shape, dtype=_F32) if out is None else out
    _, _, yt, yh = _rows(y)
    library().lib.rope_rows(x.data_ptr(), T, H, d, st, sh, cos.data_ptr(), signed_sin.data_ptr(), y.data_ptr(), yt, yh,
                            torch.get_num_threads())  # fmt: skip
    return y


def c_silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for [T, n] rows in one C call (into `out` when given, which may be gate)."""
    y = torch.empty(gate.shape, dtype=_F32) if out is None else out
    if gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1 or y.stride(-1) != 1 or y.shape != gate.shape:
        raise ValueError(f"the C gating takes [T, n] rows with a contiguous last dim, not {gate.shape}")
    T, n = gate.shape
    library().lib.silu_mul_rows(gate.data_ptr(), up.data_ptr(), y.data_ptr(), T, n, gate.stride(0), up.stride(0),
                                y.stride(0), torch.get_num_threads())  # fmt: skip
    return y


def c_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`ops.decode_attention` through the C kernel, reading keys/values [Hkv, L, d] in place."""
    if not serves(q, keys, values) or (out is not None and not out.is_contiguous()):
        raise ValueError("the C decode attention takes float32 heads with a head's positions d apart")
    return attend_one(q, keys, values, scale, out)


def model_ops(device: torch.device, dtype: torch.dtype, rounded: bool = False) -> ModelOps:
    """The row operations a model on `device` in `dtype` is built with, and why: C's for float32 on
    the CPU where the kernels built, torch's otherwise. A prompt chunk's attention then runs the
    grouped, key-blocked kernel (`chunk_attention`), or its rounded twin where the model's products
    round their rows (`rounded`, `steps.load.rounds_rows`): either gives a position the same bits
    however the prompt was cut, which SDPA does not (int8 rounding would turn its chunk-dependent
    last bits into other tokens)."""
    if device.type != "cpu" or dtype != _F32:
        why = f"torch's operations: the C row operations run float32 on the CPU, not {str(dtype)[6:]} on {device.type}"
        return ModelOps(TORCH_OPS.name, why, *_torch_calls())
    if library().lib is None:
        return ModelOps(TORCH_OPS.name, f"torch's operations: no C kernels here ({library().why_not})", *_torch_calls())
    decode, prompt = c_decode_attention, chunk_attention.attend_chunk
    how = "a prompt chunk's attention key-blocked in C, read in place"
    if not attention_rows.available():
        decode, prompt = TORCH_OPS.decode_attention, TORCH_OPS.prompt_attention
        how = "both attentions torch's (no C attention kernel)"
    elif rounded:
        prompt = chunk_attention.attend_chunk_rounded
        how = "a prompt chunk's attention key-blocked in C, read in place, in int16 dot products"
    why = f"norm, rotation and gating in C (float32 on the CPU); {how}"
    return ModelOps("C", why, c_norm, c_rotate, c_silu_mul, decode, prompt)


def _torch_calls() -> tuple:
    t = TORCH_OPS
    return t.norm, t.rotate, t.silu_mul, t.decode_attention, t.prompt_attention


def row_ops_setting(device: torch.device, ops: ModelOps | None = None) -> SettingValue:
    """The row operations a float32 model on `device` is built with, and why, as a setting: a loaded
    model's own `ops` where given (its prompt attention depends on its weights' rounding)."""
    ops = model_ops(device, _F32) if ops is None else ops
    return SettingValue("row_ops", ops.name, "C", settings.PROBE, ops.why)
