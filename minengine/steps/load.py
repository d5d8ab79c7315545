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
from minengine.fast.row_ops import model_ops
from minengine.model.transformer import Transformer
from minengine.progress import ProgressCallback


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
    ops = model_ops(device, dtype)
    return loader.build(folder, cfg, dtype, device, lambda weights: Transformer(cfg, weights, device, ops), progress,
                        packs)  # fmt: skip
