"""`reqscope plan`: KV memory, weights, concurrency and latency arithmetic for a model.

The model comes from a card shipped in `reqscope.cards` (`reqscope plan llama-3.1-8b` or
`--card NAME`), a model folder or config.json (`reqscope plan path/to/model`), or explicit
`--layers --q-heads --kv-heads --head-dim [--params]`, which also override a card's values.
Output is a table, or one JSON object with `--json`. Missing or inconsistent inputs exit with
code 2; architectures the KV formula does not describe are refused (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from minengine.config import ModelConfig
from minengine.errors import ConfigError
from minengine.kv.arithmetic import GIB, KIB, MIB
from minengine.plan.cards import Architecture, load_cards
from minengine.plan.planner import (
    DEFAULT_DTYPE,
    KV_DTYPES,
    WEIGHT_BYTES,
    Plan,
    PlanInputError,
    PlanInputs,
    parse_memory_size,
    plan,
)
from minengine.plan.service_model import ServiceModel
from reqscope.argtypes import (
    non_negative,
    positive,
    positive_whole_number,
    whole_number,
)
from reqscope.flag_aliases import deprecated_alias
from reqscope.wording import error_text, worded

_SHAPE_FLAGS = ("layers", "q_heads", "kv_heads", "head_dim")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the planner's inputs (flag names are part of the documented interface)."""
    parser.add_argument(
        "model", nargs="?", help="card name (see --list-cards), model folder or config.json"
    )
    parser.add_argument("--card", help="architecture card name")
    parser.add_argument("--list-cards", action="store_true", help="list the shipped cards")
    shape = parser.add_argument_group("architecture (override or replace a card)")
    shape.add_argument("--layers", type=positive_whole_number, help="transformer layers")
    shape.add_argument("--q-heads", type=positive_whole_number, help="query heads per layer")
    shape.add_argument("--kv-heads", type=positive_whole_number, help="key/value heads per layer")
    shape.add_argument("--head-dim", type=positive_whole_number, help="dimension of one head")
    shape.add_argument("--params", type=positive, help="total parameters, e.g. 8.03e9")
    dtypes = parser.add_argument_group("storage")
    dtypes.add_argument(
        "--kv-cache-dtype",
        choices=KV_DTYPES + ("float8_e4m3fn",),
        type=lambda name: "fp8" if name == "float8_e4m3fn" else name,  # the run flags' name for fp8
        help="KV cache element type, as vLLM's flag; float8_e4m3fn = fp8 (default: the card's, else bfloat16)",
    )
    deprecated_alias(dtypes, "--kv-dtype", "--kv-cache-dtype")
    dtypes.add_argument("--weight-dtype", choices=tuple(WEIGHT_BYTES), help="weight element type")
    dtypes.add_argument("--block-size", type=positive_whole_number, help="KV block size, in tokens")
    dtypes.add_argument("--device-memory", help="memory per replica, e.g. 80GB or 141GiB")
    work = parser.add_argument_group("request")
    work.add_argument("--input-len", type=whole_number, help="prompt tokens, as `vllm bench`'s flag")
    deprecated_alias(work, "--prompt-tokens", "--input-len")
    work.add_argument(
        "--output-len", type=positive_whole_number, help="visible output tokens (O), as `vllm bench`'s flag"
    )
    deprecated_alias(work, "--output-tokens", "--output-len")
    timing = parser.add_argument_group("latency model (ms)")
    timing.add_argument("--network-ms", type=non_negative, default=0.0, help="network, both ways")
    timing.add_argument("--queue-ms", type=non_negative, default=0.0, help="queue wait")
    timing.add_argument("--prefill-fixed-ms", type=non_negative, help="prefill fixed cost")
    timing.add_argument("--prefill-per-token-ms", type=non_negative, help="prefill per token")
    timing.add_argument("--itl-ms", type=non_negative, help="gap between output tokens")
    timing.add_argument(
        "--service-model",
        metavar="FILE",
        help="prefill and ITL from a `reqscope calibrate --output` fit instead (explicit flags still win)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the plan; return 2 for missing or inconsistent inputs."""
    cards_dir = files("reqscope.cards")
    if args.list_cards:
        for card in load_cards(cards_dir).values():
            print(f"{card.name:<24} {card.layout:<16} {card.source}")
        return 0
    try:
        arch = _architecture(args, cards_dir)
        inputs = _inputs(args, arch)
        result = plan(arch, inputs)
        result = dataclasses.replace(result, notes=tuple(map(worded, result.notes)))
    except PlanInputError as exc:
        print(f"reqscope: error: {error_text(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json(), indent=2) if args.json else render_table(result))
    return 0


def _architecture(args: argparse.Namespace, cards_dir: Traversable) -> Architecture:
    if args.card and args.model:
        raise PlanInputError("give a model or --card, not both")
    name = args.card or args.model
    base = _resolve(name, cards_dir, by_card_only=bool(args.card)) if name else None
    overrides = {flag: getattr(args, flag) for flag in (*_SHAPE_FLAGS, "params")}
    overrides = {flag: value for flag, value in overrides.items() if value is not None}
    if base is None:
        missing = [flag for flag in _SHAPE_FLAGS if flag not in overrides]
        if missing:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in missing)
            raise PlanInputError(f"no model given: name a card or config.json, or pass {flags}")
        return Architecture(name="custom", source="command-line flags", **overrides)
    try:
        return dataclasses.replace(base, **overrides)
    except ConfigError as exc:
        raise PlanInputError(exc.message) from None


def _resolve(name: str, cards_dir: Traversable, by_card_only: bool) -> Architecture:
    cards = load_cards(cards_dir)
    if name in cards:
        return cards[name]
    path = Path(name)
    if not by_card_only and (path.is_dir() or path.suffix == ".json" or path.exists()):
        # ConfigError from here (MoE, MLA, sliding window, ...) is a refusal, not a usage slip.
        return Architecture.from_config(ModelConfig.from_file(path), name=path.resolve().name)
    raise PlanInputError(f"no card or model folder named {name!r}; cards: {', '.join(cards)}")


def _inputs(args: argparse.Namespace, arch: Architecture) -> PlanInputs:
    device = None if args.device_memory is None else parse_memory_size(args.device_memory)
    prefill_fixed, prefill_per_token, itl = args.prefill_fixed_ms, args.prefill_per_token_ms, args.itl_ms
    if args.service_model:
        service = ServiceModel.load(args.service_model)
        if prefill_fixed is None and prefill_per_token is None:
            prefill_fixed, prefill_per_token = service.prefill.fixed_ms, service.prefill.per_token_ms
        if itl is None and args.input_len is not None and args.output_len is not None:
            itl = service.mean_itl_ms(args.input_len, args.output_len)
    return PlanInputs(
        kv_dtype=args.kv_cache_dtype or _card_dtype(arch.kv_dtype, KV_DTYPES, arch, "kv"),
        weight_dtype=args.weight_dtype
        or _card_dtype(arch.weight_dtype, tuple(WEIGHT_BYTES), arch, "weight"),
        prompt_tokens=args.input_len,
        output_tokens=args.output_len,
        device_memory_bytes=device,
        network_ms=args.network_ms,
        queue_ms=args.queue_ms,
        prefill_fixed_ms=prefill_fixed,
        prefill_per_token_ms=prefill_per_token,
        itl_ms=itl,
        block_size=args.block_size,
    )


def _card_dtype(value: str | None, known: tuple[str, ...], arch: Architecture, kind: str) -> str:
    if value is None:
        return DEFAULT_DTYPE
    if value not in known:
        raise PlanInputError(
            f"{arch.name} names {kind} dtype {value!r}, which the planner does not know; "
            f"pass {'--kv-cache-dtype' if kind == 'kv' else '--weight-dtype'}"
        )
    return value


def render_table(result: Plan) -> str:
    """Human-readable plan: one figure per line, binary units for KV, decimal GB for weights."""
    arch, mem, lat = result.arch, result.memory, result.latency
    rows = [
        ("model", f"{arch.name} ({arch.source})" if arch.source else arch.name),
        (
            "attention",
            f"{arch.layout}: {arch.layers} layers, {arch.q_heads} query heads, "
            f"{arch.kv_heads} KV heads, head dim {arch.head_dim}",
        ),
        ("KV dtype", result.inputs.kv_dtype),
        ("KV per token", f"{_binary(mem.kv_bytes_per_token)}, from {arch.kv_heads} KV heads"),
        ("  if MHA", f"{_binary(mem.kv_bytes_per_token_mha)}, {arch.q_heads} KV heads"),
        ("  if MQA", f"{_binary(mem.kv_bytes_per_token_mqa)}, 1 KV head"),
    ]
    if mem.prompt_kv_bytes is not None:
        tokens = result.inputs.prompt_tokens
        rows.append(("prompt KV", f"{_binary(mem.prompt_kv_bytes)}, {tokens} tokens"))
    if mem.stop_kv_bytes is not None:
        rows.append(("KV at stop", f"{_binary(mem.stop_kv_bytes)}, {mem.stop_kv_tokens} tokens"))
    if mem.stop_kv_physical_bytes is not None:
        rows.append(
            (
                "  physical",
                f"{_binary(mem.stop_kv_physical_bytes)}, {mem.stop_kv_blocks} blocks of "
                f"{result.inputs.block_size} tokens",
            )
        )
    if mem.weights_bytes is not None:
        rows.append(
            ("weights", f"{mem.weights_bytes / 1e9:,.2f} GB ({result.inputs.weight_dtype})")
        )
    if mem.max_concurrent_requests is not None:
        rows.append(
            (
                "max concurrent",
                f"{mem.max_concurrent_requests} requests beside the weights in "
                f"{mem.device_memory_bytes / 1e9:,.2f} GB",
            )
        )
    for label, value, unit in (
        ("TTFT", lat.ttft_ms, "ms"),
        ("E2E", lat.e2e_ms, "ms"),
        ("TPOT", lat.tpot_ms, "ms/token"),
        ("decode rate", lat.decode_output_tokens_per_second, "tokens/s"),
        ("whole rate", lat.whole_request_output_tokens_per_second, "tokens/s"),
    ):
        if value is not None:
            rows.append((label, f"{value:,.2f} {unit}"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += ["", *(f"note: {note}" for note in result.notes)]
    return "\n".join(lines)


def _binary(n_bytes: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n_bytes >= size:
            # Up to four decimals, trailing zeros dropped: 320.3125 MiB, 190 MiB, 0.1875 GiB.
            scaled = f"{n_bytes / size:,.4f}".rstrip("0").rstrip(".")
            return f"{scaled} {unit} ({n_bytes:,} B)"
    return f"{n_bytes:,} B"
