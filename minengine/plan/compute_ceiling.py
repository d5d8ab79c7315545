"""This machine's compute ceiling for the path prefill runs: a timed product of the model's own shape.

A prompt chunk's rows go through every layer's projections (q/k/v, o, gate/up, down), each bound
at load to its product (`weight_layout.product`: a dense `bmm`, or a packed or panel kernel's own,
with whatever activation format and tiles it chose). So the ceiling is measured through those
very products, as loaded, over a prompt-sized block of rows, on the threads a prefill step runs
on: the FLOP/s this path can reach on this machine, not the chip's theoretical peak. Attention,
the norms and Python between the ops are left out: they are what a real prefill loses against
this ceiling. The fastest pass is kept, as for the read ceiling: a ceiling is what the path can
do, and on a shared machine a slower pass is the neighbours' load.

It is measured at two chunk sizes and the faster kept. The integer tiles run at one rate from a few
dozen rows on, but the float32 GEMM a CPU without VNNI runs lays each weight out again for every
product, a cost the rows share: measured over 256 rows only, a 1,000-token prompt's whole prefill
ran well above that "ceiling" on such a CPU (docs/lab/prefill-profile.md).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import torch

from minengine.device import synchronize
from minengine.engine.engine import Engine
from minengine.engine.roofline import ComputeCeiling, flop_shape
from minengine.fast.panel_kernels import amx_takes, amx_tiles_name
from minengine.steps.step_path import weights_label

COMPUTE_ROWS = (256, 1024)  # prompt chunks' worth: enough rows that the products run their prompt path
COMPUTE_PASSES = 5  # of the whole stack of projections at each size; the fastest is kept


def prefill_path_name(engine: Engine) -> str:
    """What a compute ceiling holds for: the model, its weights' format, the compute dtype, what a prompt's
    products multiply and on what (`int16×q4_1 products on AMX tiles`: int8 rows run about twice int16's
    rate, the tiles faster again, and their emulation far slower), and the kernels when they are not the
    fast ones. A ceiling measured one way is never the yardstick of a prefill run another."""
    dtype = str(engine.dtype).removeprefix("torch.")
    # The reference kernels' model holds dense weights of the compute dtype, and its layers no fused q/k/v.
    products = dtype if engine.kernels == "reference" else weights_label(engine.model.layers[0].qkv)
    if products.startswith("int16") and amx_takes(max(COMPUTE_ROWS)):
        products += f" on {amx_tiles_name()}"
    kernels = "" if engine.kernels == "fast" else f", {engine.kernels} kernels"
    return f"{engine.model_dir.name}, {engine.weights.format} weights, {dtype}, {products} products{kernels}"


def measure_compute_ceiling(
    engine: Engine,
    machine: str,
    source: str,
    rows: tuple[int, ...] = COMPUTE_ROWS,
    passes: int = COMPUTE_PASSES,
) -> ComputeCeiling:
    """The fastest pass, as FLOP/s, of `passes` passes through every layer's projections at each of
    `rows` (a block of random rows each), and the rows it ran at.

    Runs on the model thread under a prefill step's threads. The rows are random activations of
    the model's dtype: a product's time depends on the shapes, not the values.
    """
    shape = flop_shape(engine.cfg, engine.model.decode_weight_bytes)
    rates = {n: projections_rate(engine, n, passes) for n in rows}
    best = max(rates, key=rates.__getitem__)
    sizes = f" (of {' and '.join(map(str, rows))})" if len(rows) > 1 else ""
    return ComputeCeiling(
        flops_per_s=rates[best],
        rows=best,
        probe=f"{shape.layers} layers' projections over {best} rows{sizes}, fastest of {passes} passes",
        machine=machine,
        path=prefill_path_name(engine),
        measured_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        source=source,
    )


def projections_rate(engine: Engine, rows: int, passes: int) -> float:
    """The FLOP/s of the fastest of `passes` timed passes of `rows` rows through every layer's projections."""
    runner, cfg = engine.runner, engine.cfg
    shape = flop_shape(cfg, engine.model.decode_weight_bytes)
    generator = torch.Generator().manual_seed(0)
    q_size = cfg.num_attention_heads * cfg.head_dim

    def block(width: int) -> torch.Tensor:
        return torch.randn(rows, width, generator=generator).to(device=engine.device, dtype=engine.dtype)

    hidden, attended, gated = block(cfg.hidden_size), block(q_size), block(cfg.intermediate_size)
    layers = engine.model.layers

    @torch.inference_mode()
    def one_pass() -> float:
        with runner.step_threads.step(False):
            synchronize(engine.device)
            start = time.perf_counter()
            for layer in layers:
                layer.qkv_proj(hidden)
                layer.o_proj(attended)
                layer.gate_up_proj.chunks(hidden)
                layer.down_proj(gated)
            synchronize(engine.device)
            return time.perf_counter() - start

    one_pass()  # untimed: the products' one-time costs (packing buffers, tile permission, thread wake-up)
    seconds = min(one_pass() for _ in range(passes))
    return 2 * shape.layer_params * rows / seconds
