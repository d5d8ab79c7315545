"""Write a stream of named tensors as a Hugging Face safetensors checkpoint, sharded when large.

Tensors arrive one at a time so a big model never has to sit in memory twice: a shard is
flushed to disk as soon as the next tensor would push it past the size limit. One shard is
saved as `model.safetensors`; several get the usual `-0000i-of-0000N` names plus
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def write_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Save `tensors` into `out_dir`; returns the safetensors files written, in order."""
    shard_paths: list[Path] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        path = out_dir / f".shard-{len(shard_paths):05d}.safetensors"
        save_file(pending, str(path), metadata={"format": "pt"})
        shard_paths.append(path)
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor.contiguous()
        weight_map[name] = len(shard_paths)
        pending_bytes += size
        total_bytes += size
    if pending or not shard_paths:
        flush()
    return _final_names(shard_paths, weight_map, total_bytes, out_dir)


def _final_names(
    shards: list[Path], weight_map: dict[str, int], total_bytes: int, out_dir: Path
) -> list[Path]:
    # Shards are written under provisional names because their count is unknown until the end.
    if len(shards) == 1:
        final = [out_dir / SINGLE_FILE]
    else:
        count = len(shards)
        final = [out_dir / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for provisional, path in zip(shards, final, strict=True):
        os.replace(provisional, path)
    if len(final) > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {name: final[shard].name for name, shard in sorted(weight_map.items())},
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return final
