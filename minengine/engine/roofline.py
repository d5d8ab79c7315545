"""The memory roofline of one decode step: the bytes it read, and the time a read ceiling allows.

A batch-1 decode step multiplies one vector by every weight matrix and attends over every cached
position, so it reads all the weights a step uses (`Transformer.decode_weight_bytes`, exact for
each weight format) plus the K/V of every position it attends over, once. Its arithmetic is a
few flops per byte, so the machine's read bandwidth bounds it from below:

    bytes_read  = decode weight bytes + KV read at this context length
    KV read     = 2 x layers x stored KV heads x head_dim x bytes per element x positions
                  (+ one float32 scale per position, head, K and V for FP8 storage)
    roofline_ms = bytes_read / ceiling (bytes per second)
    fraction    = roofline_ms / measured step ms   (1.0: the step ran at the ceiling)

The KV term is the seeds' formula (`minengine.kv.arithmetic`) with the layout's stored heads:
the model's own for GQA, one per query head for MHA. Only the bytes the step must read are
counted: a cache stored narrower than the compute dtype is also widened on the way (FP8, or
bfloat16 under a float32 model), traffic the formula leaves out, so such a step sits further
under the ceiling. The ceiling is measured elsewhere (the app keeps one per machine); here it
is a number with a note of where it came from. Nothing here touches a tensor: this runs
once per decode step and must not slow it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from minengine.kv.arithmetic import DTYPE_BYTES, kv_bytes
from minengine.kv.usage import KVUsage

FP8_DTYPE = "float8_e4m3fn"
FP8_SCALE_BYTES = 4  # one float32 scale per position, per stored head, for K and for V
FEWER_BYTES = 0.5  # the weights at half their bytes (float32 to 16-bit): the "what fewer bytes buy" the runs show


@dataclass(frozen=True)
class StepBytes:
    """What one decode step read from memory: the weights it multiplied by, and the K/V it attended over."""

    weights: int
    kv: int
    positions: int  # cached positions attended over (the context length of the step)

    @property
    def total(self) -> int:
        """All the bytes the step read."""
        return self.weights + self.kv


@dataclass(frozen=True)
class ReadCeiling:
    """A read bandwidth measured on a machine, and where it came from."""

    bytes_per_s: float
    probe: str  # how it was measured, e.g. "matvec over 512 MiB, fastest of 15 passes"
    machine: str  # what it was measured on, e.g. "cpu AMD EPYC 9B14, 2 threads"
    measured_at: str  # UTC, to the minute
    source: str  # what measured it (the app names its command)


@dataclass(frozen=True)
class StepRoofline:
    """One decode step against a ceiling: the time its bytes allow, beside the time it took."""

    bytes_read: int
    roofline_ms: float  # bytes_read at the ceiling
    step_ms: float  # measured: the model step and sampling
    fraction: float  # roofline_ms / step_ms


@dataclass(frozen=True)
class RooflineSummary:
    """Every decode step of a request, against a ceiling when there is one (`decode_roofline`)."""

    steps: int
    weight_bytes: int
    mean_bytes_read: float
    step_ms: float  # all the steps' measured time together
    ceiling: ReadCeiling | None
    roofline_ms: float | None  # all the steps' time at the ceiling together (None without one)

    @property
    def fraction(self) -> float | None:
        """The ceiling's time for the whole decode over the time it took: one fraction for the request."""
        if self.roofline_ms is None or self.step_ms <= 0:
            return None
        return self.roofline_ms / self.step_ms

    @property
    def weight_share(self) -> float:
        """The weights' part of the bytes an average step read."""
        return self.weight_bytes / self.mean_bytes_read if self.mean_bytes_read else 0.0

    def tokens_per_s_at(self, weight_scale: float = 1.0) -> float | None:
        """Decode steps a second the ceiling allows, with the weights in `weight_scale` times their bytes."""
        if self.ceiling is None:
            return None
        kv = self.mean_bytes_read - self.weight_bytes
        return self.ceiling.bytes_per_s / (self.weight_bytes * weight_scale + kv)


def kv_read_bytes(kv: KVUsage) -> int:
    """K/V bytes a decode step reads when the cache holds `kv` (the positions it attended over)."""
    return kv_position_bytes(kv) * kv.tokens


def kv_position_bytes(kv: KVUsage) -> int:
    """K/V bytes one cached position adds to a decode step's read, all layers (FP8's scales too)."""
    payload = kv_bytes(kv.layers, kv.stored_heads, kv.head_dim, DTYPE_BYTES[kv.dtype], 1)
    scales = 2 * kv.layers * kv.stored_heads * FP8_SCALE_BYTES if kv.dtype == FP8_DTYPE else 0
    return payload + scales


def step_bytes(weight_bytes: int, kv: KVUsage) -> StepBytes:
    """The bytes of a decode step that read `weight_bytes` of weights and left the cache as `kv`."""
    return StepBytes(weight_bytes, kv_read_bytes(kv), kv.tokens)


def roofline_ms(bytes_read: int | float, ceiling: ReadCeiling) -> float:
    """Milliseconds reading `bytes_read` takes at the ceiling."""
    if ceiling.bytes_per_s <= 0:
        raise ValueError("a read ceiling must be positive")
    return bytes_read / ceiling.bytes_per_s * 1000


def step_roofline(read: StepBytes, step_ms: float, ceiling: ReadCeiling) -> StepRoofline:
    """One step's bytes against the ceiling, and the fraction of it the step reached."""
    allowed = roofline_ms(read.total, ceiling)
    return StepRoofline(read.total, allowed, step_ms, allowed / step_ms if step_ms > 0 else 0.0)


def decode_roofline(steps: Iterable[tuple[StepBytes, float]], ceiling: ReadCeiling | None) -> RooflineSummary | None:
    """The decode steps `(bytes read, measured ms)` of one request, against `ceiling` when given; None without steps."""
    count, total_bytes, measured, weights = 0, 0, 0.0, 0
    for read, ms in steps:
        count += 1
        total_bytes += read.total
        measured += ms
        weights = read.weights
    if not count:
        return None
    allowed = None if ceiling is None else roofline_ms(total_bytes, ceiling)
    return RooflineSummary(count, weights, total_bytes / count, measured, ceiling, allowed)
