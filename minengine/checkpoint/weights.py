"""Checkpoint loading: safetensors only, single file or sharded, memory-mapped.

Pickle checkpoints (`*.bin`, `*.pt`, `*.pth`) can execute code when loaded, so they are refused.
Every tensor is checked against the shapes the config implies; missing, unexpected or
mis-shaped tensors are reported together.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minengine.config import ModelConfig
from minengine.errors import WeightsError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Buffers some exporters save that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes a checkpoint of `cfg` must contain."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, refusing pickle-only checkpoints."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise WeightsError(f"{index} is not a valid safetensors index: {exc}") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    pickles = [p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise WeightsError(
            f"{folder} has only pickle checkpoints ({', '.join(pickles[:3])}), which can run code "
            "when loaded and are refused; convert them to safetensors first"
        )
    raise WeightsError(f"no model.safetensors in {folder}; is it a Hugging Face model folder?")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Path, object]]:
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"cannot read {path.name}: {exc} (the file is corrupted or truncated)") from None
        with handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, path, handle


def load_state_dict(
    folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Read, validate and cast every tensor the model needs."""
    expected = expected_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    misshaped: list[str] = []
    for name, path, handle in _iter_tensors(checkpoint_files(folder)):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding matrix is the head
        if name not in expected:
            unexpected.append(name)
            continue
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, RuntimeError) as exc:
            raise WeightsError(f"cannot read tensor {name} from {path.name}: {exc}") from None
        if tuple(tensor.shape) != expected[name]:
            misshaped.append(f"{name} {tuple(tensor.shape)} != {expected[name]}")
            continue
        tensors[name] = tensor.to(device=device, dtype=dtype)
    missing = [n for n in expected if n not in tensors and not any(n in m for m in misshaped)]
    problems = []
    if missing:
        problems.append(f"missing {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listing(unexpected)}")
    if misshaped:
        problems.append(f"wrong shape {_listing(misshaped)}")
    if problems:
        raise WeightsError(f"checkpoint in {folder} does not match config.json: " + "; ".join(problems))
    return tensors


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} tensor(s): {shown}{more}"
