"""`reqscope metrics`: request metrics, KV footprint and window rates as one JSON object.

Each block is optional and printed only when all of its inputs are given:

* the timeline CSV gives TTFT and E2E; adding --output-len gives TPOT and both rates;
* --layers/--kv-heads/--head-dim/--kv-bytes give KV bytes per token; --input-len adds the
  prompt's KV, and --output-len the KV held when the request stops;
* --window-seconds/--attempted/--successful/--slo-passing give throughput, goodput, error rate.

Bad input exits with code 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from minengine.engine.metrics import MetricsInputError, SystemWindow, request_latency, request_metrics
from minengine.kv.arithmetic import MIB, kv_bytes_per_token
from minengine.plan.planner import tokens_at_stop
from minengine.record.timeline_csv import read_timeline
from reqscope.argtypes import positive, whole_number
from reqscope.flag_aliases import deprecated_alias
from reqscope.wording import error_text

SCOPE = (
    "full causal attention with one K and one V vector per KV head (MHA/GQA/MQA); "
    "logical, unsharded KV payload; visible output only; times on one clock"
)
# Each group's flags (name, type, help): a group counts when all its flags are given, and some
# without the rest is an error (`_group_given`).
_KV_INPUTS = (
    ("layers", whole_number, "transformer layers"),
    ("kv_heads", whole_number, "KV heads per layer (not query heads)"),
    ("head_dim", whole_number, "dimension of one head"),
    ("kv_bytes", positive, "bytes per stored element (bf16 = 2)"),
)
_WINDOW_INPUTS = (
    ("window_seconds", positive, "measurement window length"),
    ("attempted", whole_number, "requests attempted in the window"),
    ("successful", whole_number, "requests that succeeded"),
    ("slo_passing", whole_number, "successful requests meeting SLOs"),
)
_KV_FLAGS = tuple(name for name, _, _ in _KV_INPUTS)
_WINDOW_FLAGS = tuple(name for name, _, _ in _WINDOW_INPUTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the calculator's inputs."""
    parser.add_argument("timeline", nargs="?", help="request timeline CSV (event,time_ms,detail)")
    parser.add_argument("--output-len", type=whole_number, help="visible output tokens (O), as `vllm bench`'s flag")
    deprecated_alias(parser, "--output-tokens", "--output-len")
    kv = parser.add_argument_group("KV footprint")
    for name, kind, text in _KV_INPUTS:
        kv.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    kv.add_argument("--input-len", type=whole_number, help="prompt tokens, as `vllm bench`'s flag")
    deprecated_alias(kv, "--input-tokens", "--input-len")
    window = parser.add_argument_group("system window")
    for name, kind, text in _WINDOW_INPUTS:
        window.add_argument("--" + name.replace("_", "-"), type=kind, help=text)


def run(args: argparse.Namespace) -> int:
    """Print the metrics JSON; return 2 on input the calculator cannot use."""
    try:
        artifact = _artifact(args)
    except MetricsInputError as exc:
        print(f"reqscope: error: {error_text(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(artifact, indent=2))
    return 0


def _artifact(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {"scope": SCOPE}
    if _group_given(args, _KV_FLAGS, "KV footprint"):
        per_token = kv_bytes_per_token(args.layers, args.kv_heads, args.head_dim, args.kv_bytes)
        out["kv_bytes_per_token"] = per_token
        if args.input_len is not None:
            out["prompt_kv_mib"] = per_token * args.input_len / MIB
            if args.output_len is not None:
                stop = tokens_at_stop(args.input_len, _at_least_one(args.output_len))
                out["stop_kv_mib"] = per_token * stop / MIB
    if args.timeline is not None:
        timeline = read_timeline(args.timeline)
        s, f, e = timeline.send_ms, timeline.first_token_ms, timeline.last_token_ms
        if args.output_len is None:
            out["ttft_ms"], out["e2e_ms"] = request_latency(s, f, e)
        else:
            metrics = request_metrics(s, f, e, args.output_len)
            out["ttft_ms"] = metrics.ttft_ms
            out["e2e_ms"] = metrics.e2e_ms
            out["tpot_ms"] = metrics.tpot_ms
            out["decode_output_tokens_per_second"] = metrics.decode_output_tokens_per_second
            out["whole_request_output_tokens_per_second"] = (
                metrics.whole_request_output_tokens_per_second
            )
    if _group_given(args, _WINDOW_FLAGS, "system window"):
        window = SystemWindow(
            window_seconds=args.window_seconds,
            attempted=args.attempted,
            successful=args.successful,
            slo_passing=args.slo_passing,
        )
        out["request_throughput_rps"] = window.request_throughput_rps
        out["observed_goodput_rps"] = window.observed_goodput_rps
        out["error_rate"] = window.error_rate
    if len(out) == 1:
        raise MetricsInputError(
            "nothing to compute: give a timeline CSV, the KV flags or the window flags"
        )
    return out


def _group_given(args: argparse.Namespace, names: tuple[str, ...], label: str) -> bool:
    """True if every flag of a group is set, False if none is; a partial group is an error."""
    missing = [name for name in names if getattr(args, name) is None]
    if len(missing) == len(names):
        return False
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise MetricsInputError(f"the {label} also needs {flags}")
    return True


def _at_least_one(output_tokens: int) -> int:
    if output_tokens < 1:
        raise MetricsInputError("--output-len must be >= 1")
    return output_tokens
