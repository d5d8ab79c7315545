"""Loading a checkpoint into a model, through the CPU weight-layout cache.

On the CPU the built layout of a pulled model is cached beside its checkpoint and mapped on
later loads (`layout_cache` says why and what it saves); the checkpoint is validated whenever
the layout is built. Elsewhere, or for a folder the user brought, the checkpoint is read and
validated every time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from minengine.checkpoint import layout_cache
from minengine.checkpoint.weight_format import DTYPE_FORMAT
from minengine.checkpoint.weight_layout import CheckpointReader, WeightSource
from minengine.checkpoint.weights import checkpoint_files, load_state_dict
from minengine.config import ModelConfig
from minengine.fast.panel_kernels import PANEL_PACKS
from minengine.progress import TENSORS, ProgressCallback, Stage

M = TypeVar("M")


def build(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    make: Callable[[WeightSource], M],
    progress: ProgressCallback | None = None,
    packs: str | None = None,
) -> M:
    """`make(weights)` over the checkpoint in `folder`: its cached layout when one fits, else the
    validated checkpoint (recording the layout it builds, where the cache is wanted).

    Building and writing a layout (a first load, about a second here) is reported to `progress`
    as a "layout" stage (checkpoint tensors laid out) and a "cache" stage (bytes written).
    A panel format (`PANEL_PACKS`) is cached as its panels; with another packed weight format
    (`packs`) the projections are packed from the checkpoint every time: FBGEMM's and oneDNN's
    packed weights are opaque objects, not tensors a file could map.
    """
    cachable = packs is None or packs in PANEL_PACKS  # FBGEMM's and oneDNN's packs are opaque objects
    if device.type != "cpu" or not cachable or not layout_cache.wanted(folder):
        return make(CheckpointReader(load_state_dict(folder, cfg, dtype, device), packs))
    weights = packs or DTYPE_FORMAT.get(dtype, str(dtype))  # a dense layout's format is its dtype's
    key = layout_cache.layout_key(folder, checkpoint_files(folder), dtype, weights)
    path = layout_cache.layout_path(folder, key, weights)
    cached = layout_cache.open_layout(path, weights)
    if cached is not None:
        try:
            return make(cached)
        except (KeyError, RuntimeError):
            pass  # a layout that does not fit this build: rebuild it below
    reader = CheckpointReader(load_state_dict(folder, cfg, dtype, device), packs)
    building = Stage(progress, "layout", len(reader.sd), TENSORS, folder.name)
    recorder = layout_cache.RecordingReader(reader, building)
    model = make(recorder)
    building.finish(f"{len(recorder.made)} operands")
    layout_cache.write_layout(path, recorder.made, weights, progress, recorder.panels)
    return model
