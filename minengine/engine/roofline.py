"""The two rooflines of a run: a decode step's bytes against the read ceiling, prefill's FLOPs
against the compute ceiling, and the rows a step at which the second binds instead of the first.

Decode:

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

Prefill multiplies a prompt's rows by the same weights, every row once: its arithmetic grows with
the rows while the weights are read once, so from some rows a step on the machine's compute
bounds it instead (`prefill_flops` counts the arithmetic, `prefill_roofline` sets it against a
`ComputeCeiling`, measured by `reqscope calibrate` through the model's own projections):

    intensity(R) = 2 x projection parameters x R / weight bytes    (FLOPs per byte of a step of R rows)
    ridge        = compute ceiling / read ceiling                   (FLOPs per byte where both bind)
    crossover    = the R at which intensity(R) = ridge               (`crossover_rows`)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minengine.kv.arithmetic import DTYPE_BYTES, kv_bytes
from minengine.kv.usage import KVUsage

if TYPE_CHECKING:
    from minengine.config import ModelConfig

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


@dataclass(frozen=True)
class ComputeCeiling:
    """The FLOP/s the path prefill runs reached on a machine, measured through the model's own projections."""

    flops_per_s: float
    rows: int  # the rows a pass multiplied, a prompt chunk's worth
    probe: str  # how it was measured, e.g. "30 layers' projections over 256 rows, fastest of 5 passes"
    machine: str  # what it was measured on (as `ReadCeiling.machine`)
    path: str  # the model and the weights' format it holds for, e.g. "SmolLM2-135M-Instruct, q4_1 weights, float32"
    measured_at: str  # UTC, to the minute
    source: str  # what measured it


@dataclass(frozen=True)
class FlopShape:
    """What a row of the model costs in arithmetic, and what a step reads of its weights (`flop_shape`)."""

    layer_params: int  # every layer's projection parameters together (q/k/v, o, gate/up, down)
    head_params: int  # the head's (vocab x hidden): prefill runs it for the last position only
    layers: int
    q_heads: int
    head_dim: int
    weight_bytes: int  # what one step reads of the weights (`Transformer.decode_weight_bytes`)


def flop_shape(cfg: ModelConfig, weight_bytes: int) -> FlopShape:
    """The arithmetic of a model of config `cfg` whose steps read `weight_bytes` of weights."""
    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * cfg.intermediate_size
    return FlopShape(per_layer * cfg.num_hidden_layers, cfg.vocab_size * hidden, cfg.num_hidden_layers,
                     cfg.num_attention_heads, cfg.head_dim, weight_bytes)  # fmt: skip


def prefill_flops(shape: FlopShape, tokens: int, start: int = 0) -> int:
    """FLOPs of prefilling positions [start, start + tokens), the one place this formula is written:

        FLOPs = 2 x projection parameters x tokens                       (each row through every layer)
              + 2 x head parameters                                       (the last position's logits)
              + 4 x head_dim x q heads x layers x sum of contexts        (attention: q.k and p.v)
        sum of contexts = (start + 1) + (start + 2) + ... + (start + tokens)

    A multiply-add is 2 FLOPs; position p attends over p + 1 positions, so attention costs
    4 x (p + 1) x head_dim per query head and layer. The last layer runs its output projection
    and MLP for the last position only; the formula counts them for every row, over by less than
    one layer's share (1/layers) of the projections: it is a count of the model's arithmetic, not
    of the shortcuts a path takes.
    """
    return 2 * shape.layer_params * tokens + 2 * shape.head_params + prefill_attention_flops(shape, tokens, start)


def prefill_attention_flops(shape: FlopShape, tokens: int, start: int = 0) -> int:
    """The attention term of `prefill_flops`: the part that grows with the context, not the tokens alone."""
    contexts = tokens * start + tokens * (tokens + 1) // 2
    return 4 * shape.head_dim * shape.q_heads * shape.layers * contexts


@dataclass(frozen=True)
class PrefillRoofline:
    """A prefill's FLOPs against the compute ceiling, and where a step's rows cross from memory- to compute-bound."""

    tokens: int  # computed (the prefix cache's left out)
    flops: int
    attention_flops: int  # the part of `flops` that is attention over the context (`prefill_attention_flops`)
    prefill_ms: float
    rows: int  # the most rows one of its steps multiplied (its largest chunk)
    ceiling: ComputeCeiling | None
    crossover: float | None  # rows a step from which compute binds (None without both ceilings)

    @property
    def flops_per_token(self) -> float:
        """The prefill's FLOPs over its computed tokens."""
        return self.flops / self.tokens if self.tokens else 0.0

    @property
    def attention_share(self) -> float:
        """Attention's share of the prefill's FLOPs: small for a short prompt, most of a very long one's."""
        return self.attention_flops / self.flops if self.flops else 0.0

    @property
    def flops_per_s(self) -> float:
        """Achieved: the prefill's FLOPs over its measured time."""
        return self.flops / (self.prefill_ms / 1000) if self.prefill_ms > 0 else 0.0

    @property
    def bound(self) -> str | None:
        """What bound its largest step: "compute" from the crossover's rows on, else "memory" (None without
        both ceilings)."""
        if self.crossover is None:
            return None
        return "compute" if self.rows >= self.crossover else "memory"

    @property
    def fraction(self) -> float | None:
        """The achieved FLOP/s over the ceiling's (None without one)."""
        if self.ceiling is None or self.ceiling.flops_per_s <= 0:
            return None
        return self.flops_per_s / self.ceiling.flops_per_s


def step_intensity(shape: FlopShape, rows: int) -> float:
    """FLOPs per weight byte of a step of `rows` rows, each through every projection (the head included)."""
    return 2 * (shape.layer_params + shape.head_params) * rows / shape.weight_bytes


def crossover_rows(shape: FlopShape, compute: ComputeCeiling, read: ReadCeiling) -> float:
    """Rows a step from which compute binds instead of bandwidth: where `step_intensity` meets the ridge point
    (compute ceiling / read ceiling, FLOPs per byte)."""
    if compute.flops_per_s <= 0 or read.bytes_per_s <= 0:
        raise ValueError("both ceilings must be positive")
    return compute.flops_per_s / read.bytes_per_s / step_intensity(shape, 1)


def prefill_roofline(
    shape: FlopShape,
    tokens: int,
    start: int,
    prefill_ms: float,
    rows: int,
    compute: ComputeCeiling | None,
    read: ReadCeiling | None,
) -> PrefillRoofline:
    """A prefill of `tokens` from position `start` that took `prefill_ms`, its largest step `rows` rows,
    against the ceilings there are."""
    cross = None if compute is None or read is None else crossover_rows(shape, compute, read)
    flops, attention = prefill_flops(shape, tokens, start), prefill_attention_flops(shape, tokens, start)
    return PrefillRoofline(tokens, flops, attention, prefill_ms, rows, compute, cross)
