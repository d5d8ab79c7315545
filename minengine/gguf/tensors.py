"""GGUF tensors as Hugging Face tensors: names mapped, blocks dequantized, llama Q/K rows restored.

GGUF stores a matrix as (out_features, in_features) in numpy order, which is already the
Hugging Face layout, so no transpose is needed. llama.cpp's converter does reorder the rows
of llama Q and K projections, though: it interleaves the two halves of each head so that its
RoPE can rotate adjacent pairs. Hugging Face rotates the first half against the second
(`rotate_half`), so those rows have to be put back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from minengine.errors import WeightsError
from minengine.gguf.hparams import GGUFHyperParams

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class HFTensor:
    """One converted tensor: its Hugging Face name and float32 values in HF layout."""

    name: str
    values: np.ndarray


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); WeightsError for names a llama/qwen2 model
    does not have."""
    if match := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _PER_LAYER:
            return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}"
    elif (match := _TOP_NAME.fullmatch(gguf_name)) and match.group(1) in _TOP_LEVEL:
        return f"{_TOP_LEVEL[match.group(1)]}.{match.group(2)}"
    raise WeightsError(f"GGUF tensor {gguf_name!r} has no Hugging Face llama/qwen2 counterpart")


def unpermute_rotary_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K rows (weights or biases).

    Within each head, GGUF row 2*i + j holds Hugging Face row j*head_dim/2 + i.
    """
    head_dim = rows.shape[0] // n_heads
    grouped = rows.reshape(n_heads, head_dim // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(rows.shape))


def iter_hf_tensors(reader: GGUFReader, hparams: GGUFHyperParams) -> Iterator[HFTensor]:
    """Every tensor of the GGUF, dequantized to float32 and in Hugging Face layout.

    Checks first that the names it will produce are exactly the ones `hparams` requires, so
    a converted folder never loads with silently initialised weights.
    """
    _check_complete({hf_tensor_name(t.name) for t in reader.tensors}, hparams)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        values = _dequantized(tensor.data, tensor.tensor_type, tensor.name)
        if hparams.architecture == "llama":
            if ".q_proj." in name:
                values = unpermute_rotary_rows(values, hparams.config.num_attention_heads)
            elif ".k_proj." in name:
                values = unpermute_rotary_rows(values, hparams.config.num_key_value_heads)
        yield HFTensor(name, values)


def _dequantized(data: np.ndarray, qtype: GGMLQuantizationType, name: str) -> np.ndarray:
    try:
        values = dequantize(data, qtype)
    except NotImplementedError:
        raise WeightsError(
            f"GGUF tensor {name!r} uses {qtype.name}, which the installed gguf package cannot "
            "dequantize; upgrade gguf or use a file with another quantization"
        ) from None
    # F32 tensors come back as read-only views of the memory-mapped file.
    return np.array(values, dtype=np.float32, copy=not values.flags.writeable)


def _check_complete(seen: set[str], hparams: GGUFHyperParams) -> None:
    expected = hparams.expected_tensors()
    if missing := sorted(expected - seen):
        raise WeightsError(
            f"GGUF lacks {len(missing)} tensor(s) a {hparams.config.model_type} model needs, "
            f"e.g. {missing[0]}; the file is incomplete"
        )
    if extra := sorted(seen - expected):
        raise WeightsError(
            f"GGUF has tensor(s) the {hparams.config.model_type} config does not use, e.g. {extra[0]}"
        )
