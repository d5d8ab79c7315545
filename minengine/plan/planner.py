"""Memory and latency planning for one request on one model replica.

Memory is logical, unsharded payload: the KV formula in `kv.arithmetic` (from KV heads, never query
heads) times the tokens the cache holds, and weights as params x bytes per weight. Physical
allocation adds block rounding (reported when a block size is given), quantization scales
(omitted), padding, workspace and activations (omitted); the notes in a Plan say so.

Latency follows a simple service model:

    TTFT = network + queue + prefill_fixed + prefill_per_token x prompt_tokens
    E2E  = TTFT + (O - 1) x ITL

Only O - 1 inter-token gaps follow the first token, whose arrival closes TTFT. Some texts
write E2E = TTFT + O x ITL (one gap too many); this planner does not, and feeds the synthetic
timeline through minengine.engine.metrics so its TPOT and rates use the same definitions as measured
requests.

At the end of a request the cache holds prompt + O - 1 tokens: the last sampled token is
streamed but never fed back, so its K and V are never computed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from minengine.engine.metrics import MetricsInputError, request_metrics
from minengine.errors import ConfigError, EngineText, Setting
from minengine.kv.arithmetic import DTYPE_BYTES, blocks_for, kv_bytes_per_token
from minengine.plan.cards import NONSTANDARD_ATTENTION, Architecture

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8")
WEIGHT_BYTES: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}
DEFAULT_DTYPE = "bfloat16"

_UNIT_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*$")


class PlanInputError(MetricsInputError):
    """Planner inputs that are missing, negative or inconsistent."""


class UnsupportedLayoutError(ConfigError):
    """The model retains state the standard KV formula does not describe."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan may use besides the architecture; None means "not given"."""

    kv_dtype: str = DEFAULT_DTYPE
    weight_dtype: str = DEFAULT_DTYPE
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    device_memory_bytes: int | None = None
    network_ms: float = 0.0
    queue_ms: float = 0.0
    prefill_fixed_ms: float | None = None
    prefill_per_token_ms: float | None = None
    itl_ms: float | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of KV cache and weights; KV is logical unless named physical."""

    kv_bytes_per_token: int
    kv_bytes_per_token_mha: int
    kv_bytes_per_token_mqa: int
    prompt_kv_bytes: int | None
    stop_kv_tokens: int | None
    stop_kv_bytes: int | None
    stop_kv_blocks: int | None
    stop_kv_physical_bytes: int | None
    weights_bytes: int | None
    device_memory_bytes: int | None
    max_concurrent_requests: int | None


@dataclass(frozen=True)
class LatencyPlan:
    """Client-observed latency of a request under the service model (ms, tokens/s)."""

    ttft_ms: float | None
    e2e_ms: float | None
    tpot_ms: float | None
    decode_output_tokens_per_second: float | None
    whole_request_output_tokens_per_second: float | None


@dataclass(frozen=True)
class Plan:
    """A planned request: architecture, dtypes, memory, latency and the caveats that apply."""

    arch: Architecture
    inputs: PlanInputs
    memory: MemoryPlan
    latency: LatencyPlan
    notes: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        """Flat JSON object; figures whose inputs were not given are left out."""
        figures: dict[str, object] = {
            "model": self.arch.name,
            "attention": self.arch.layout,
            "layers": self.arch.layers,
            "q_heads": self.arch.q_heads,
            "kv_heads": self.arch.kv_heads,
            "head_dim": self.arch.head_dim,
            "kv_dtype": self.inputs.kv_dtype,
            "weight_dtype": self.inputs.weight_dtype,
            "kv_block_size": self.inputs.block_size,
            **vars(self.memory),
            **vars(self.latency),
        }
        out = {key: value for key, value in figures.items() if value is not None}
        out["notes"] = list(self.notes)
        return out


def parse_memory_size(text: str) -> int:
    """Bytes in a size like '80GB' (decimal, 10^9) or '80GiB' (binary, 2^30); a unit is required."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNIT_BYTES:
        raise PlanInputError(
            f"memory size {text!r} needs a number and a unit such as 80GB (decimal) or 80GiB "
            "(binary)"
        )
    return int(float(match.group(1)) * _UNIT_BYTES[unit])


def tokens_at_stop(prompt_tokens: int, output_tokens: int) -> int:
    """Cached positions once the last of `output_tokens` is emitted: prompt + O - 1."""
    if output_tokens < 1:
        raise PlanInputError("output_tokens must be >= 1")
    return prompt_tokens + output_tokens - 1


def check_kv_formula_applies(arch: Architecture) -> None:
    """Raise UnsupportedLayoutError for layouts the per-KV-head formula would misstate."""
    if arch.kv_formula_applies:
        return
    raise UnsupportedLayoutError(
        f"{arch.name} uses {arch.layout} attention, which "
        f"{NONSTANDARD_ATTENTION[arch.attention]}; the 2 x layers x kv_heads x head_dim formula "
        "would print a wrong number, so ",
        Setting.PLANNER,
        " refuses it",
    )


def plan(arch: Architecture, inputs: PlanInputs) -> Plan:
    """Memory and latency figures for `arch` under `inputs` (refuses nonstandard layouts)."""
    check_kv_formula_applies(arch)
    _check_inputs(inputs)
    return Plan(
        arch=arch,
        inputs=inputs,
        memory=_memory(arch, inputs),
        latency=_latency(inputs),
        notes=_notes(arch, inputs),
    )


def _memory(arch: Architecture, inputs: PlanInputs) -> MemoryPlan:
    elem = DTYPE_BYTES[inputs.kv_dtype]
    per_token = kv_bytes_per_token(arch.layers, arch.kv_heads, arch.head_dim, elem)
    prompt, output = inputs.prompt_tokens, inputs.output_tokens
    prompt_kv = None if prompt is None else per_token * prompt
    stop_tokens = None
    if prompt is not None and output is not None:
        stop_tokens = tokens_at_stop(prompt, output)
    stop_kv = None if stop_tokens is None else per_token * stop_tokens
    stop_blocks = physical = None
    if stop_tokens is not None and inputs.block_size is not None:
        stop_blocks = blocks_for(stop_tokens, inputs.block_size)
        physical = stop_blocks * inputs.block_size * per_token
    weights = None
    if arch.params is not None:
        weights = math.ceil(arch.params * WEIGHT_BYTES[inputs.weight_dtype])
    return MemoryPlan(
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_mha=kv_bytes_per_token(arch.layers, arch.q_heads, arch.head_dim, elem),
        kv_bytes_per_token_mqa=kv_bytes_per_token(arch.layers, 1, arch.head_dim, elem),
        prompt_kv_bytes=prompt_kv,
        stop_kv_tokens=stop_tokens,
        stop_kv_bytes=stop_kv,
        stop_kv_blocks=stop_blocks,
        stop_kv_physical_bytes=physical,
        weights_bytes=weights,
        device_memory_bytes=inputs.device_memory_bytes,
        max_concurrent_requests=_max_concurrent(
            inputs.device_memory_bytes, weights, physical if physical is not None else stop_kv
        ),
    )


def _max_concurrent(
    device_bytes: int | None, weights: int | None, per_request: int | None
) -> int | None:
    if device_bytes is None or weights is None or per_request is None:
        return None
    spare = device_bytes - weights
    if spare <= 0:
        return 0
    # A zero-token request (empty prompt, one output token) holds no cache at all.
    return spare // per_request if per_request else None


def _latency(inputs: PlanInputs) -> LatencyPlan:
    ttft = _ttft(inputs)
    if ttft is None or inputs.itl_ms is None or inputs.output_tokens is None:
        return LatencyPlan(ttft, None, None, None, None)
    last = ttft + (inputs.output_tokens - 1) * inputs.itl_ms
    try:
        metrics = request_metrics(0.0, ttft, last, inputs.output_tokens)
    except MetricsInputError as exc:
        raise PlanInputError("latency inputs describe no valid request: ", exc.message) from None
    # The plan's figures are the request metrics of the same names, from the same formulas.
    return LatencyPlan(**{f.name: getattr(metrics, f.name) for f in fields(LatencyPlan)})


def _ttft(inputs: PlanInputs) -> float | None:
    if inputs.prefill_fixed_ms is None and inputs.prefill_per_token_ms is None:
        return None
    per_token = 0.0
    if inputs.prefill_per_token_ms is not None:
        if inputs.prompt_tokens is None:
            raise PlanInputError("a per-token prefill cost needs prompt_tokens")
        per_token = inputs.prefill_per_token_ms * inputs.prompt_tokens
    fixed = inputs.prefill_fixed_ms or 0.0
    return inputs.network_ms + inputs.queue_ms + fixed + per_token


def _check_inputs(inputs: PlanInputs) -> None:
    if inputs.kv_dtype not in KV_DTYPES:
        raise PlanInputError(
            f"kv dtype {inputs.kv_dtype!r} unknown (one of {', '.join(KV_DTYPES)})"
        )
    if inputs.weight_dtype not in WEIGHT_BYTES:
        raise PlanInputError(
            f"weight dtype {inputs.weight_dtype!r} unknown (one of {', '.join(WEIGHT_BYTES)})"
        )
    for name in ("prompt_tokens", "device_memory_bytes"):
        value = getattr(inputs, name)
        if value is not None and value < 0:
            raise PlanInputError(f"{name} must be >= 0, got {value}")
    if inputs.output_tokens is not None and inputs.output_tokens < 1:
        raise PlanInputError(f"output_tokens must be >= 1, got {inputs.output_tokens}")
    if inputs.block_size is not None and inputs.block_size < 1:
        raise PlanInputError(f"block_size must be >= 1, got {inputs.block_size}")
    for name in ("network_ms", "queue_ms", "prefill_fixed_ms", "prefill_per_token_ms", "itl_ms"):
        value = getattr(inputs, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise PlanInputError(f"{name} must be a finite number >= 0, got {value}")


def _notes(arch: Architecture, inputs: PlanInputs) -> tuple[str, ...]:
    notes = [
        f"KV per token uses the {arch.kv_heads} KV heads, not the {arch.q_heads} query heads; "
        "the MHA and MQA figures show the same model with q_heads and with 1 KV head",
        "memory is the logical, unsharded KV payload; padding, workspace and activations are "
        "not included, and tensor parallelism may shard or replicate KV heads",
    ]
    if inputs.block_size is None:
        notes.append(EngineText("no ", Setting.BLOCK_SIZE, ": physical block rounding not shown"))
    else:
        notes.append(
            f"physical KV rounds each request up to whole {inputs.block_size}-token blocks"
        )
    if inputs.kv_dtype == "fp8":
        notes.append("fp8 KV: per-tensor or per-block scale factors are omitted")
    if inputs.output_tokens is not None:
        notes.append(
            "KV at stop holds prompt + output - 1 tokens: the last token is never fed back"
        )
    if arch.params is None:
        notes.append("parameter count unknown: weights and max concurrency not computed")
    elif inputs.device_memory_bytes is not None:
        weights = arch.params * WEIGHT_BYTES[inputs.weight_dtype]
        if weights >= inputs.device_memory_bytes:
            notes.append(
                "the weights alone fill the device memory: shard the model or quantize weights"
            )
    return tuple(notes)
