"""The observer a captured step's row carries through the forward: its attention weights and residuals.

The model calls it (`rows.RowObserver`) with what it already has in hand: each layer's
query of the row's last position and the keys it attends over, and the row's residual stream
after each block. It computes the softmax weights itself, from those same operands with the
same arithmetic as `ops.decode_attention`, and never touches the step's own outputs, so a
captured step's logits are those of the same step uncaptured. Nothing leaves the device here;
`summary` turns what was kept into records after the step.
"""

from __future__ import annotations

import time

import torch

from minengine.inspect.ask import InspectAsk
from minengine.model.ops import constant


class StepObserver:
    """What one row of one step shows inside, kept as tensors until the step is done."""

    def __init__(self, ask: InspectAsk, layers: int, hidden: int, scale: float, dtype: torch.dtype, device) -> None:
        self.ask = ask
        self.scale = scale
        self.weights: list[torch.Tensor | None] = [None] * layers  # [Hq, context] float32 per layer
        self.residuals = torch.empty(layers, hidden, dtype=dtype, device=device) if ask.lens else None
        self.kv_heads = 0  # the stored K/V heads the keys came in (the query heads under mha)
        self.work_ns = 0  # time spent in these callbacks (on a GPU: issuing them)

    def attended(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Layer `layer`'s query of the row's last position, q [Hq, d] (or grouped [Hkv, Hq/Hkv, d]),
        over keys [H stored, context, d] in the compute dtype (dequantized, for FP8)."""
        if not self.ask.attention:
            return
        t0 = time.perf_counter_ns()
        self.kv_heads = keys.shape[0]
        grouped = q.reshape(keys.shape[0], -1, q.shape[-1])
        scores = torch.baddbmm(constant(0.0, grouped), grouped, keys.transpose(1, 2), beta=0, alpha=self.scale)
        self.weights[layer] = scores.softmax(dim=-1, dtype=torch.float32).reshape(-1, keys.shape[1])
        self.work_ns += time.perf_counter_ns() - t0

    def residual(self, layer: int, x: torch.Tensor) -> None:
        """The row's residual stream [hidden] after block `layer` (copied: the stream is added to in place)."""
        if self.residuals is not None:
            t0 = time.perf_counter_ns()
            self.residuals[layer].copy_(x)
            self.work_ns += time.perf_counter_ns() - t0

    @property
    def complete(self) -> bool:
        """Whether every layer reported what was asked (a failed or cut-short step leaves gaps)."""
        return not self.ask.attention or all(w is not None for w in self.weights)
