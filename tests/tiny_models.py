"""Tiny random Hugging Face models of every supported family, saved as safetensors folders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class TinySpec:
    """A named tiny config: model family plus overrides of BASE."""

    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)


SPECS = [
    TinySpec("llama-gqa", "llama"),
    TinySpec("llama-mha-tied", "llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    TinySpec("llama-mqa", "llama", {"num_key_value_heads": 1}),
    TinySpec(
        "llama3-rope",
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
        },
    ),
    TinySpec("llama-linear-rope", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    TinySpec("mistral", "mistral", {"sliding_window": None}),
    TinySpec("qwen2", "qwen2", {"tie_word_embeddings": True}),
    TinySpec("qwen3", "qwen3", {"head_dim": 32}),
]


def build_tiny(spec: TinySpec, folder: Path, seed: int = 0):
    """Create a seeded random model with transformers and save it to `folder`; return it."""
    model = random_model(spec.model_type, BASE | spec.overrides, seed)
    config = model.config
    # Random init is small; widen it so logits spread and greedy choices are decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(1.0, 0.1) if p.shape[0] == config.hidden_size else p.normal_(0.0, 0.05)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def build_tiny_with_tokenizer(spec: TinySpec, folder: Path, tokenizer_from: Path) -> None:
    """`build_tiny`, then the tokenizer files of the model folder `tokenizer_from` copied beside it."""
    import shutil

    build_tiny(spec, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)


def random_model(model_type: str, config: dict, seed: int):
    """A float32 transformers model of `model_type` built from `config`, initialised from `seed`."""
    import transformers

    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    hf_config = config_cls(**config)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
