"""The flags that choose how the engine is opened (--model, --device, --dtype, --weights, --kv-budget-mib),
declared once.

run, serve, calibrate and the benchmark each open an engine; each names the flags it takes, in the
order its --help lists them, and may word a help line for its own context.
"""

from __future__ import annotations

import argparse

from minengine.dtype_names import DTYPE_CHOICES, WEIGHT_CHOICES

MODEL_HELP = "model folder (default: the pulled SmolLM2-135M-Instruct)"
DTYPE_HELP = "weights and compute (half = float16)"
# One line: the formats, their kernels and the activations' variable are told in docs/performance.md.
WEIGHTS_HELP = (
    "how the projections are stored, in llama.cpp's and vLLM's short names (auto: q4_1 on the CPU for a Q4_1 "
    "checkpoint such as the default model's, else fp16; see docs/performance.md, 'Weight formats')"
)


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *flags: str,
    model_help: str = MODEL_HELP,
    dtype_help: str = DTYPE_HELP,
) -> None:
    """Add the named engine flags ("model", "device", "dtype", "weights", "kernels", "kv_budget_mib", "max_num_seqs",
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
            case "kernels":
                parser.add_argument(
                    "--kernels",
                    default="fast",
                    choices=("fast", "reference"),
                    help="fast: the engine's own paths (C stack, panels, CUDA graphs); reference: every forward "
                    "through the plain PyTorch model in minengine/reference, dense weights (slower, the oracle)",
                )
            case "kv_budget_mib":
                parser.add_argument(
                    "--kv-budget-mib", type=float, help="KV memory budget for admission (default: half of free memory)"
                )
            case "max_num_seqs":
                parser.add_argument(
                    "--max-num-seqs",
                    type=int,
                    help="most sequences one engine step runs together, as vLLM's flag (default: as many as the KV "
                    "pool holds and a step's token budget gives a token each, at most 256)",
                )
            case "max_num_batched_tokens":
                parser.add_argument(
                    "--max-num-batched-tokens",
                    type=int,
                    help="tokens one engine step may schedule, decode and prefill chunks together; a longer prompt "
                    "is prefilled in chunks, as vLLM's flag (default: 80 on the CPU, 56 where its products "
                    "multiply float32 rows, 2048 there while nothing decodes, 2048 on CUDA)",
                )
            case _:
                raise ValueError(f"no engine flag {flag!r}")
