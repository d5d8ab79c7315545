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
WEIGHTS_HELP = (
    "the projections' storage, in llama.cpp's and vLLM's short names: float32, fp16, bf16, int8 (per-channel, "
    "activations quantized too), q8_0 and q4_1 (llama.cpp's blocks of 32, q4_1's head in q8_0); on the CPU, "
    "around float32 compute, float32, fp16, q8_0 and q4_1 run in reqscope's panel kernel (built once with the "
    "system C compiler; FBGEMM's fp16 without one) and bf16/int8 in torch's packed kernels, elsewhere the compute "
    "dtype's own (default auto: on the CPU q4_1 for a checkpoint of Q4_1 blocks, which it holds exactly, as the "
    "default model's, else fp16, the fastest measured to keep float32's greedy tokens); on a CPU with AVX-512 "
    "VNNI q8_0 and q4_1 round each row to int16 per 32 inputs and multiply in integers (float32's logits within "
    "1e-7 nats); REQSCOPE_ACTIVATIONS=float32 keeps float32 rows, =int8 rounds them to int8 as llama.cpp does "
    "(faster shared steps, logits no longer float32's)"
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
                    help="most sequences one engine step runs together (vLLM's; default: as many as the KV pool "
                    "holds and a step's token budget gives a token each, at most 256)",
                )
            case "max_num_batched_tokens":
                parser.add_argument(
                    "--max-num-batched-tokens",
                    type=int,
                    help="tokens one engine step may schedule, decode and prefill chunks together; a longer prompt "
                    "is prefilled in chunks (vLLM's; default 64 on the CPU, 2048 there while nothing decodes, "
                    "2048 on CUDA)",
                )
            case _:
                raise ValueError(f"no engine flag {flag!r}")
