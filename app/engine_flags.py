"""The flags that choose how the engine is opened (--model, --device, --dtype, --weights, --kv-budget-mib,
and the step limits --max-num-seqs and --max-num-batched-tokens), declared once.

run, serve, calibrate and the benchmark each open an engine; each names the flags it takes, in the
order its --help lists them, and may word a help line for its own context.
"""

from __future__ import annotations

import argparse

from minengine.dtype_names import DTYPE_CHOICES, WEIGHT_CHOICES
from reqscope.argtypes import whole_number

MODEL_HELP = "model folder (default: the pulled SmolLM2-135M-Instruct)"
DTYPE_HELP = "weights and compute (half = float16)"
WEIGHTS_HELP = (
    "the projections' storage, in llama.cpp's and vLLM's short names: float32, fp16, bf16, int8 (per-channel); "
    "on the CPU fp16/bf16/int8 are packed kernels around float32 compute, elsewhere the compute dtype's own "
    "(default auto: the fastest format measured to keep float32's greedy tokens, fp16 on the CPU)"
)


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *flags: str,
    model_help: str = MODEL_HELP,
    dtype_help: str = DTYPE_HELP,
) -> None:
    """Add the named engine flags ("model", "device", "dtype", "weights", "kv_budget_mib", "max_num_seqs",
    "max_num_batched_tokens") to `parser`, in order."""
    for flag in flags:
        match flag:
            case "model":
                parser.add_argument("--model", metavar="PATH", help=model_help)
            case "device":
                parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
            case "dtype":
                parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=dtype_help)
            case "weights":
                parser.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES, help=WEIGHTS_HELP)
            case "kv_budget_mib":
                parser.add_argument(
                    "--kv-budget-mib", type=float, help="KV memory budget for admission (default: half of free memory)"
                )
            case "max_num_seqs":
                # whole_number, not a positive one: 0 reaches the engine, whose one-line error says why not.
                parser.add_argument(
                    "--max-num-seqs",
                    type=whole_number,
                    metavar="N",
                    help="most sequences one engine step runs together, vLLM's name (default: the engine's)",
                )
            case "max_num_batched_tokens":
                parser.add_argument(
                    "--max-num-batched-tokens",
                    type=whole_number,
                    metavar="N",
                    help="most tokens one engine step schedules, decode tokens and prompt chunks together; "
                    "a longer prompt prefills in chunks, vLLM's name (default: the engine's)",
                )
            case _:
                raise ValueError(f"no engine flag {flag!r}")
