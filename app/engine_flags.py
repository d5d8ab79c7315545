"""The flags that choose how the engine is opened (--model, --device, --dtype, --kv-budget-mib), declared once.

run, serve, calibrate and the benchmark each open an engine; each names the flags it takes, in the
order its --help lists them, and may word a help line for its own context.
"""

from __future__ import annotations

import argparse

from minengine.dtype_names import DTYPE_CHOICES

MODEL_HELP = "model folder (default: the pulled SmolLM2-135M-Instruct)"
DTYPE_HELP = "weights and compute (half = float16)"


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *flags: str,
    model_help: str = MODEL_HELP,
    dtype_help: str = DTYPE_HELP,
) -> None:
    """Add the named engine flags ("model", "device", "dtype", "kv_budget_mib") to `parser`, in the order given."""
    for flag in flags:
        match flag:
            case "model":
                parser.add_argument("--model", metavar="PATH", help=model_help)
            case "device":
                parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
            case "dtype":
                parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=dtype_help)
            case "kv_budget_mib":
                parser.add_argument(
                    "--kv-budget-mib", type=float, help="KV memory budget for admission (default: half of free memory)"
                )
            case _:
                raise ValueError(f"no engine flag {flag!r}")
