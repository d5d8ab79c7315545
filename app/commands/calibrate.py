"""`reqscope calibrate`: fit the seeds' service-time model to this engine on this device.

Prints the fitted prefill and decode lines beside seed 003's numbers with a small plot of the
measured points, or one JSON object with `--json`; `--output FILE` saves the fit for
`reqscope plan --service-model FILE`. First it measures the machine's read ceiling and keeps it
in the reqscope home (`reqscope.bench.ceiling`), for the roofline every run shows;
`--ceiling-only` measures just that (a few seconds, no model). With the model loaded it then
measures the compute ceiling of the path prefill runs (`minengine.plan.compute_ceiling`: the
model's own projections over a prompt chunk's rows) and keeps it beside, for prefill's roofline;
`--ceilings-only` measures both and stops there. Where other processes used more than a quarter of
a core meanwhile (`reqscope.bench.other_load`), a warning says the ceiling is likely low, and the
kept probe says how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TypeVar

from minengine.engine.roofline import ComputeCeiling, ReadCeiling
from minengine.plan.calibrate import (
    DEFAULT_CONTEXT_LENGTHS,
    DEFAULT_DECODE_STEPS,
    DEFAULT_PROMPT_LENGTHS,
    DEFAULT_REPEATS,
    CalibrationPlan,
)
from minengine.plan.service_model import (
    SEED_DECODE_STEP_MS,
    SEED_PREFILL_FIXED_MS,
    SEED_PREFILL_PER_TOKEN_MS,
    LineFit,
    Point,
    ServiceModel,
)
from minengine.threads import model_thread
from reqscope.argtypes import positive_whole_number
from reqscope.bench.other_load import OtherLoad, OtherLoadMeter
from reqscope.engine_flags import add_engine_arguments

PLOT_WIDTH, PLOT_HEIGHT = 56, 10
C = TypeVar("C", ReadCeiling, ComputeCeiling)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of token counts, e.g. 16,64,256") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be whole numbers of at least 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, device and what to measure."""
    add_engine_arguments(parser, "model", "device", "dtype", "weights", "kernels", dtype_help="weights and compute")
    parser.add_argument(
        "--prompt-lengths", type=_lengths, default=DEFAULT_PROMPT_LENGTHS, metavar="N,N,...",
        help=f"prefill prompt lengths (default: {','.join(map(str, DEFAULT_PROMPT_LENGTHS))})",
    )  # fmt: skip
    parser.add_argument(
        "--context-lengths", type=_lengths, default=DEFAULT_CONTEXT_LENGTHS, metavar="N,N,...",
        help=f"decode context lengths (default: {','.join(map(str, DEFAULT_CONTEXT_LENGTHS))})",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=positive_whole_number, default=DEFAULT_REPEATS, help="measurements per length"
    )
    parser.add_argument(
        "--decode-steps", type=positive_whole_number, default=DEFAULT_DECODE_STEPS, help="decode steps timed per point"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--output", metavar="FILE", help="also save the fit as JSON (for `plan --service-model`)")
    parser.add_argument(
        "--ceiling-only", action="store_true",
        help="only measure the read-bandwidth ceiling the runs' roofline uses, and keep it (no model, a few seconds)",
    )  # fmt: skip
    parser.add_argument(
        "--ceilings-only", action="store_true",
        help="measure the read ceiling and the model's compute ceiling (prefill's roofline), keep both, no fit",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Measure the read ceiling, then (unless --ceiling-only) the compute ceiling, then (unless --ceilings-only)
    fit and print; the fit is saved to --output when given."""
    from minengine.device import resolve_device
    from minengine.engine.engine import Engine
    from minengine.plan.calibrate import calibrate
    from minengine.plan.compute_ceiling import measure_compute_ceiling
    from reqscope.bench.ceiling import MEASURED_BY, machine_name, measure_ceiling, save_ceiling, save_compute_ceiling
    from reqscope.console.progress_line import ProgressLine
    from reqscope.run_options import ModelFolder, stderr_progress

    folder = None if args.ceiling_only else ModelFolder.of(args).ensure(stderr_progress)  # a bad one fails first
    # Before the model loads: the probe's buffer and the weights are never in memory together.
    with OtherLoadMeter() as meter:
        ceiling = measure_ceiling(resolve_device(args.device))
    ceiling = _marked(ceiling, meter.load, "read ceiling")
    kept = save_ceiling(ceiling)
    if folder is None:
        print(json.dumps(asdict(ceiling), indent=2) if args.json else ceiling_line(ceiling, kept))
        return 0
    if not args.ceilings_only:
        print(f"reqscope: {ceiling_line(ceiling, kept)}", file=sys.stderr)
    plan = CalibrationPlan(args.prompt_lengths, args.context_lengths, args.repeats, args.decode_steps)
    engine = Engine(folder, device=args.device, dtype=args.dtype, weights=args.weights, kernels=args.kernels)
    machine = machine_name(engine.device)
    with OtherLoadMeter() as meter:
        compute = model_thread().call(lambda: measure_compute_ceiling(engine, machine, MEASURED_BY))
    compute = _marked(compute, meter.load, "compute ceiling")
    kept = save_compute_ceiling(compute)
    if args.ceilings_only:
        both = {"read_ceiling": asdict(ceiling), "compute_ceiling": asdict(compute)}
        lines = f"{ceiling_line(ceiling, kept)}\n{compute_line(compute, kept)}"
        print(json.dumps(both, indent=2) if args.json else lines)
        return 0
    print(f"reqscope: {compute_line(compute, kept)}", file=sys.stderr)
    line = ProgressLine(prefix="reqscope: ")  # redrawn in place on a terminal, start and end lines otherwise
    try:
        model = model_thread().call(lambda: calibrate(engine, plan, progress=line))  # where the engine steps
    finally:
        line.close()
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as out:
                json.dump(model.as_json(), out, indent=2)
                out.write("\n")
        except OSError as exc:
            print(f"reqscope: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    print(json.dumps(model.as_json(), indent=2) if args.json else render(model))
    return 0


def _marked(ceiling: C, load: OtherLoad, name: str) -> C:
    """`ceiling`, its probe noting the other processes' load when they pulled it down (and a warning
    line saying so); as measured otherwise."""
    if not load.disturbed:
        return ceiling
    print(
        f"reqscope: warning: {load.describe().replace(' meanwhile', '')} while the {name} was measured, so it is "
        "likely low and fractions of it high; run `reqscope calibrate --ceilings-only` again on a quiet machine",
        file=sys.stderr,
    )
    return replace(ceiling, probe=f"{ceiling.probe}; {load.describe()}")


def ceiling_line(ceiling: ReadCeiling, kept: Path) -> str:
    """The measured ceiling, what it was measured on, and where it is kept."""
    return (
        f"read ceiling {ceiling.bytes_per_s / 1e9:.1f} GB/s on {ceiling.machine} ({ceiling.probe}); "
        f"kept in {kept} for the runs' roofline"
    )


def compute_line(ceiling: ComputeCeiling, kept: Path) -> str:
    """The measured compute ceiling, the path and machine it holds for, and where it is kept."""
    return (
        f"compute ceiling {ceiling.flops_per_s / 1e9:.1f} GFLOP/s for {ceiling.path} on {ceiling.machine} "
        f"({ceiling.probe}); kept in {kept} for prefill's roofline"
    )


def render(model: ServiceModel) -> str:
    """The fit beside the seed's model, and a plot of the points and lines."""
    p, d = model.prefill, model.decode
    lines = [
        f"{model.model} on {model.device} ({model.dtype})",
        "",
        f"prefill_ms = {p.fixed_ms:.2f} + {p.per_token_ms:.4f} x prompt tokens    R² {p.r2:.3f}",
        f"   seed 003: {SEED_PREFILL_FIXED_MS:g} + {SEED_PREFILL_PER_TOKEN_MS:g} x prompt tokens"
        "   (a 70B model on a GPU)",
        f"decode_ms  = {d.fixed_ms:.2f} + {d.per_token_ms:.5f} x context tokens   R² {d.r2:.3f}",
        f"   seed 003: about {SEED_DECODE_STEP_MS:g} ms per step",
        "",
        "prefill: ms against prompt tokens (o measured, - fit)",
        *_plot([q for q in model.points if q.kind == "prefill"], p),
        "",
        "decode step: ms against context tokens (o measured, - fit)",
        *_plot([q for q in model.points if q.kind == "decode"], d),
    ]
    return "\n".join(lines)


def _plot(points: Sequence[Point], fit: LineFit) -> list[str]:
    xs = [q.tokens for q in points]
    x_lo, x_hi = min(xs), max(xs)
    ys = [q.ms for q in points] + [fit.at(x_lo), fit.at(x_hi)]
    y_lo, y_hi = min(ys), max(ys)
    x_span, y_span = max(x_hi - x_lo, 1), max(y_hi - y_lo, 1e-9)
    grid = [[" "] * PLOT_WIDTH for _ in range(PLOT_HEIGHT)]

    def cell(x: float, y: float) -> tuple[int, int]:
        col = round((x - x_lo) / x_span * (PLOT_WIDTH - 1))
        row = PLOT_HEIGHT - 1 - round((y - y_lo) / y_span * (PLOT_HEIGHT - 1))
        return row, col

    for col in range(PLOT_WIDTH):
        row, _ = cell(x_lo + col / (PLOT_WIDTH - 1) * x_span, fit.at(x_lo + col / (PLOT_WIDTH - 1) * x_span))
        grid[row][col] = "-"
    for q in points:
        row, col = cell(q.tokens, q.ms)
        grid[row][col] = "o"
    labels = [f"{y_hi:9.1f} |", *([" " * 9 + " |"] * (PLOT_HEIGHT - 2)), f"{y_lo:9.1f} |"]
    rows = [label + "".join(r) for label, r in zip(labels, grid, strict=True)]
    axis = " " * 10 + "+" + "-" * PLOT_WIDTH
    ticks = " " * 11 + f"{x_lo:<{PLOT_WIDTH // 2}}{x_hi:>{PLOT_WIDTH - PLOT_WIDTH // 2}}"
    return [*rows, axis, ticks]
