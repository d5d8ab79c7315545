"""Tiny GGUF files for import tests, exported from random Hugging Face models.

The export follows llama.cpp's converter: llama Q/K rows interleaved per head, tied models
without `output.weight`, a byte-level BPE vocabulary stored as tokens + merges. The permutation
is written out here independently of minengine, so a round trip checks the converter against
llama.cpp's layout rather than against itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from tiny_models import BASE, random_model
from tokenizers import pre_tokenizers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ Ġ")
USER_DEFINED = "<tool>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROPE_THETA = 5000.0  # not transformers' default, so a dropped value shows in the logits

_PER_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True)
class TinyVocab:
    """A byte-level BPE vocabulary: specials, the 256 byte symbols, then merge results."""

    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


@dataclass(frozen=True)
class TinyGGUF:
    """What a tiny GGUF was written from: the source model and which tensors were quantized."""

    path: Path
    model: torch.nn.Module
    vocab: TinyVocab
    quantized: tuple[str, ...] = field(default=())


def tiny_vocab() -> TinyVocab:
    """The shared test vocabulary (about 270 tokens)."""
    merged = tuple(m.replace(" ", "") for m in MERGES)
    tokens = (*SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet()), *merged, USER_DEFINED)
    types = (
        (TokenType.CONTROL,) * len(SPECIALS)
        + (TokenType.NORMAL,) * (len(tokens) - len(SPECIALS) - 1)
        + (TokenType.USER_DEFINED,)
    )
    return TinyVocab(tokens, tuple(int(t) for t in types), MERGES)


def tiny_hf_model(model_type: str, vocab_size: int, *, tied: bool, seed: int = 0):
    """A seeded random transformers model with every weight (norms and biases too) non-trivial."""
    config = BASE | {
        "vocab_size": vocab_size,
        "intermediate_size": 96,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": tied,
    }
    model = random_model(model_type, config, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.1)
    return model.eval()


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's reordering of llama Q/K rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (
        rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def gguf_name(hf_name: str) -> str:
    """GGUF tensor name for a Hugging Face one."""
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_PER_LAYER[part]}.{kind}"


def write_tiny_gguf(
    path: Path,
    model_type: str = "llama",
    *,
    tied: bool = False,
    pre: str = "smollm",
    architecture: str | None = None,
    q8_0: tuple[str, ...] = (),
    seed: int = 0,
) -> TinyGGUF:
    """Export a fresh tiny model to `path`; `q8_0` lists HF tensor names stored as Q8_0."""
    vocab = tiny_vocab()
    model = tiny_hf_model(model_type, len(vocab.tokens), tied=tied, seed=seed)
    config = model.config
    arch = architecture or model_type
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    for name, param in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        values = param.detach().numpy().astype(np.float32)
        if model_type == "llama" and ".q_proj." in name:
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif model_type == "llama" and ".k_proj." in name:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        if name in q8_0:
            writer.add_tensor(
                gguf_name(name), quantize(values, GGMLQuantizationType.Q8_0),
                raw_dtype=GGMLQuantizationType.Q8_0,
            )  # fmt: skip
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, model, vocab, q8_0)


def reference_state_dict(tiny: TinyGGUF) -> dict[str, torch.Tensor]:
    """The source model's weights as the GGUF holds them (Q8_0 tensors rounded the same way)."""
    state = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    for name in tiny.quantized:
        rounded = quantize(state[name].numpy(), GGMLQuantizationType.Q8_0)
        state[name] = torch.from_numpy(dequantize(rounded, GGMLQuantizationType.Q8_0).copy())
    if tiny.model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
