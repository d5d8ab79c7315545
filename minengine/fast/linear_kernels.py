"""The CPU's packed linear kernels, behind one door: what the installed torch offers, packing, applying.

Decode is memory-bound: a step streams every projection once for very little arithmetic, so
fewer bytes per weight is most of the speed there is. Three packed kernels store a float32
model's projections in fewer bytes and compute in float32 around them, and a fourth keeps
float32's bytes in a layout whose products of a few rows cost what one row's does:

- `float32`: oneDNN's packed float32 linear (`mkldnn._reorder_linear_weight` +
  `_linear_pointwise`), the same numbers as a dense float32 matrix summed in oneDNN's order.
  MKL's small-M GEMM behind `F.linear`/`bmm` costs 2-3x its one-row GEMV for 2..8 rows, where
  oneDNN's packed kernel costs about what its one row does; but that one row streams the matrix
  slower than the dense operands' GEMV (`weight_format` says what that decides). Packed for
  `PACK_BATCH_HINT` rows, each row's product is the same bits whatever the number of rows
  beside it (1 to 1,025 tested) and whatever the thread count, so batching and prefill change
  no projection's value;

- `fp16`: FBGEMM's packed half-precision weights (`quantized.linear_prepack_fp16` and
  `linear_dynamic_fp16`): half the bytes, relative error about 2e-4 per product;
- `int8`: FBGEMM's dynamic int8 (the kernel behind `torch.ao.nn.quantized.dynamic.Linear`),
  weights quantized symmetrically per output channel, activations per call: a quarter of the
  bytes, about 1.5% relative error per product;
- `bf16`: oneDNN's packed bfloat16 linear, on CPUs with AVX-512 (BF16 or BW/VL/DQ).

torch 2.13 warns that FBGEMM's packing and the quantized-tensor constructors "will be removed in
a future PyTorch release", so nothing else in the engine names these ops: `available` runs each
kernel once on a tiny matrix and says why one is missing, and the choice of format
(`weight_format`) falls back to float32 with that reason. The packed objects are opaque, so
their bytes are computed from FBGEMM's blocking (`PackedLinear.stored_bytes`, checked against
the allocator in the tests).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

PACKED_FORMATS = ("float32", "fp16", "bf16", "int8")
# The rows oneDNN's float32 packing is tuned for. With 8 (a shared step's rows) a row's product
# does not depend on the rows beside it; packed for 1 row, the products of 2+ rows sum in
# another order (tests/engine/test_float32_kernel.py).
PACK_BATCH_HINT = 8
# FBGEMM packs K (the input features) in blocks of this many rows, padding the last block: what
# is stored, not what is read (a step's kernel stops at the last real row).
_FBGEMM_ROW_BLOCK = 512
_FBGEMM_FP16_SLACK = 1024  # bytes FBGEMM's pipelined fp16 kernels read past the matrix
# int8 accumulates in int32: activations are 7-bit (reduce_range, as torch.ao's x86 default,
# since AVX2's vpmaddubsw saturates pairs of full-range products) and weights 8-bit, so a dot
# product of more than this many terms could overflow.
INT8_MAX_IN_FEATURES = (2**31 - 1) // (127 * 128)


def _fp16_column_block() -> int:
    """FBGEMM's fp16 column block: two vectors of float32 lanes (16 with AVX-512, 8 with AVX2)."""
    return 32 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 16


def _int8_column_block() -> int:
    """FBGEMM's int8 column block (PackingTraits NCB, 32-bit accumulation)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def _ceil_to(n: int, block: int) -> int:
    return -(-n // block) * block


class PackedLinear:
    """One projection in a packed kernel's storage: `linear(x)` is x [T, in] @ W.T, [T, out], float32.

    `chunks` keeps the dense operand's output layout (`weight_layout.project_chunks` hands back
    [chunks, T, out/chunks]): gate and up stay two chunks for the MLP.
    """

    __slots__ = ("format", "packed", "in_features", "out_features", "chunks", "stored_bytes", "read_bytes")

    def __init__(self, fmt: str, weight: torch.Tensor, chunks: int) -> None:
        """Pack a float32 [out, in] weight (the caller drops it afterwards)."""
        out_features, in_features = weight.shape
        self.format, self.in_features, self.out_features, self.chunks = fmt, in_features, out_features, chunks
        weight = weight.float().contiguous()
        if fmt == "fp16":
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
            columns = _ceil_to(out_features, _fp16_column_block())
            self.stored_bytes = _ceil_to(in_features, _FBGEMM_ROW_BLOCK) * columns * 2 + _FBGEMM_FP16_SLACK
            self.read_bytes = in_features * columns * 2
        elif fmt == "int8":
            self.packed = _pack_int8(weight)
            columns = _ceil_to(out_features, _int8_column_block())
            per_channel = out_features * 12  # int32 column offsets, float32 scales, int32 zero points
            self.stored_bytes = _ceil_to(in_features, _FBGEMM_ROW_BLOCK) * columns + per_channel
            self.read_bytes = _ceil_to(in_features, 4) * columns + per_channel  # rows interleaved by 4
        elif fmt == "float32":
            with warnings.catch_warnings():  # a private op: `available` says when it is missing
                warnings.simplefilter("ignore")
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            self.stored_bytes = self.read_bytes = out_features * in_features * 4
        elif fmt == "bf16":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), None)
            self.stored_bytes = self.read_bytes = self.packed.numel() * self.packed.element_size()
        else:
            raise ValueError(f"no packed kernel {fmt!r}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense operand's shape, [chunks, in, out/chunks]."""
        return (self.chunks, self.in_features, self.out_features // self.chunks)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (float32) times the weight: [T, out], float32."""
        if self.format == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        if self.format == "int8":
            return torch.ops.quantized.linear_dynamic(x, self.packed, True)
        if self.format == "float32":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.packed, None, "none", [], "").float()


def _pack_int8(weight: torch.Tensor) -> torch.ScriptObject:
    """Symmetric per-output-channel int8 weights, packed for FBGEMM's dynamic linear."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_(min=1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the deprecation is `available`'s business, said once there
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


class EmbeddingRows:
    """The token embedding in a packed format's storage (fp16/bf16 rows, or int8 rows and per-row scales).

    A packed head cannot hand out a column, so a tied embedding is kept once more, at the
    format's width; a step reads one row of it.
    """

    __slots__ = ("rows", "scales")

    def __init__(self, fmt: str, weight: torch.Tensor) -> None:
        """`weight` [vocab, hidden], float32."""
        self.scales: torch.Tensor | None = None
        if fmt == "int8":
            self.scales = (weight.abs().amax(dim=1) / 127).clamp_(min=1e-12)
            self.rows = torch.round(weight / self.scales[:, None]).to(torch.int8)
        else:
            self.rows = weight.to(torch.float16 if fmt == "fp16" else torch.bfloat16)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for token ids [T], float32 [T, hidden] (a fresh tensor)."""
        rows = F.embedding(ids, self.rows).float()
        return rows if self.scales is None else rows.mul_(self.scales[ids, None])

    @property
    def stored_bytes(self) -> int:
        """Bytes held."""
        extra = 0 if self.scales is None else self.scales.numel() * 4
        return self.rows.numel() * self.rows.element_size() + extra

    @property
    def row_bytes(self) -> int:
        """Bytes one token's lookup reads."""
        return self.rows.shape[1] * self.rows.element_size() + (0 if self.scales is None else 4)


@dataclass(frozen=True)
class KernelProbe:
    """Whether a packed format runs with this torch on this CPU, and if not, why."""

    format: str
    ok: bool
    why_not: str = ""


@cache
def available(fmt: str) -> KernelProbe:
    """Pack and run `fmt`'s kernel once on a tiny matrix against float32 (cached per process)."""
    weight = torch.linspace(-1, 1, 64 * 32).view(64, 32)
    x = torch.linspace(-1, 1, 32).view(1, 32)
    try:
        if fmt == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return KernelProbe(fmt, False, "this CPU has no oneDNN bf16 path (it needs AVX-512)")
        if fmt in ("float32", "bf16") and not torch.backends.mkldnn.is_available():
            return KernelProbe(fmt, False, "this torch build has no oneDNN")
        y = PackedLinear(fmt, weight, 1).linear(x)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return KernelProbe(fmt, False, f"this torch build has no {fmt} linear kernel ({first[:120]})")
    error = float((y - x @ weight.t()).norm() / (x @ weight.t()).norm())
    if not error < (1e-5 if fmt == "float32" else 0.05):  # float32 differs only in summation order
        return KernelProbe(fmt, False, f"the {fmt} kernel's test product is off by {error:.0%}")
    return KernelProbe(fmt, True)


def int8_refusal(name: str, shape: tuple[int, int]) -> str | None:
    """Why the int8 kernel cannot hold the [out, in] weight `name`, or None when it can."""
    if shape[1] > INT8_MAX_IN_FEATURES:
        return (
            f"{name} has {shape[1]} input features, more than the int8 kernel's int32 accumulator "
            f"holds ({INT8_MAX_IN_FEATURES})"
        )
    return None
