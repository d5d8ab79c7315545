"""Building the model for this machine: its weights in the chosen format, its row operations bound.

Everything a step could otherwise choose per call is fixed here, once: the projections' operands
(`checkpoint.loader`, through the CPU layout cache) and the block's row operations, C's or
torch's (`fast.row_ops.model_ops`). The model then runs the same way every step, and
`Transformer.ops.why` says which were bound and why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minengine.checkpoint import loader
from minengine.config import ModelConfig
from minengine.fast import chunk_attention
from minengine.fast.panel_kernels import rows_rounding
from minengine.fast.row_ops import model_ops
from minengine.model.transformer import Transformer
from minengine.progress import ProgressCallback


def rounds_rows(cfg: ModelConfig, device: torch.device, packs: str | None) -> bool:
    """Whether the model's products round their rows (int16 or int8 activations over block weights, on
    the CPU), so that its prompt attention takes the chunk kernel's rounded twin where it runs for
    the model's head size: one rounding scheme through the whole prompt, not float32 attention
    between rounded products."""
    rounds = packs is not None and rows_rounding(packs.split("-")[0]) != "float32"  # "q4_1-exact" is q4_1's panels
    return device.type == "cpu" and rounds and chunk_attention.rounded(cfg.head_dim)


def load_model(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    progress: ProgressCallback | None = None,
    *,
    packs: str | None = None,
) -> Transformer:
    """The checkpoint in `folder` as a `Transformer` (validated, through the layout cache, whose
    first build reports to `progress`); `packs` names a packed weight format (`linear_kernels`),
    None keeps dense operands in `dtype`. Its row operations are this machine's (`model_ops`)."""
    ops = model_ops(device, dtype, rounds_rows(cfg, device, packs))
    return loader.build(folder, cfg, dtype, device, lambda weights: Transformer(cfg, weights, device, ops), progress,
                        packs)  # fmt: skip
