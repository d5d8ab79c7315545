"""Architecture hyper-parameters of a llama or qwen2 GGUF, and the Hugging Face configs they imply.

GGUF keeps hyper-parameters as `{arch}.*` metadata; a Hugging Face folder keeps them in
`config.json` and `generation_config.json`. Anything a GGUF can express that the converted
folder could not reproduce exactly (partial rotary, YaRN, llama3 frequency factors, experts)
is refused here, before any tensor is touched.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from minengine.errors import ConfigError, Setting, WeightsError
from minengine.gguf.metadata import GGUFMetadata

# general.architecture -> (config.json model_type, architectures entry)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}


@dataclass(frozen=True)
class GGUFHyperParams:
    """What config.json needs, read from GGUF metadata and the list of tensor names."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_linear_factor: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    @classmethod
    def from_gguf(
        cls, meta: GGUFMetadata, tensor_shapes: dict[str, tuple[int, ...]]
    ) -> GGUFHyperParams:
        """Read and check the hyper-parameters; `tensor_shapes` maps GGUF tensor names to shapes
        in numpy order (rows first)."""
        arch = meta.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"GGUF architecture {arch!r} is not supported; `",
                Setting.GGUF_IMPORT,
                f"` converts {' and '.join(SUPPORTED_ARCHITECTURES)} models",
            )
        _refuse_unsupported(meta, arch, tensor_shapes)
        embedding = tensor_shapes.get("token_embd.weight")
        if embedding is None:
            raise WeightsError(
                f"{arch} GGUF has no token_embd.weight tensor; the file is incomplete"
            )
        hidden = meta.get_int(f"{arch}.embedding_length")
        n_heads = meta.get_int(f"{arch}.attention.head_count")
        head_dim = meta.get_int(f"{arch}.attention.key_length", hidden // n_heads)
        value_dim = meta.get_int(f"{arch}.attention.value_length", head_dim)
        rotary_dim = meta.get_int(f"{arch}.rope.dimension_count", head_dim)
        if value_dim != head_dim or rotary_dim != head_dim:
            raise ConfigError(
                f"GGUF has key length {head_dim}, value length {value_dim} and rotary dimension "
                f"{rotary_dim}; only models where all three match can be converted"
            )
        eos = meta.get_int("tokenizer.ggml.eos_token_id", None)
        eot = meta.get_int("tokenizer.ggml.eot_token_id", None)
        return cls(
            architecture=arch,
            vocab_size=embedding[0],
            hidden_size=hidden,
            intermediate_size=meta.get_int(f"{arch}.feed_forward_length"),
            num_hidden_layers=meta.get_int(f"{arch}.block_count"),
            num_attention_heads=n_heads,
            num_key_value_heads=meta.get_int(f"{arch}.attention.head_count_kv", n_heads),
            head_dim=head_dim,
            rms_norm_eps=meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=meta.get_float(f"{arch}.rope.freq_base", 10000.0),
            rope_linear_factor=_linear_rope_factor(meta, arch),
            max_position_embeddings=meta.get_int(f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            bos_token_id=meta.get_int("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
            pad_token_id=meta.get_int("tokenizer.ggml.padding_token_id", None),
        )

    @property
    def model_type(self) -> str:
        """config.json `model_type`."""
        return SUPPORTED_ARCHITECTURES[self.architecture][0]

    def hf_config(self, torch_dtype: str) -> dict[str, Any]:
        """The content of config.json for this model, weights stored as `torch_dtype`."""
        model_type, class_name = SUPPORTED_ARCHITECTURES[self.architecture]
        config: dict[str, Any] = {
            "architectures": [class_name],
            "model_type": model_type,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": (
                {"rope_type": "linear", "factor": self.rope_linear_factor}
                if self.rope_linear_factor
                else None
            ),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _one_or_many(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
            "torch_dtype": torch_dtype,
        }
        if model_type == "llama":
            config |= {"attention_bias": self.attention_bias, "mlp_bias": False}
        else:
            # Qwen2 always has q/k/v biases; its sliding window is off in every released model.
            config |= {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": self.num_hidden_layers,
            }
        return config

    def generation_config(self) -> dict[str, Any]:
        """The content of generation_config.json: the ids that end a reply."""
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _one_or_many(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }

    def expected_tensors(self) -> set[str]:
        """Every Hugging Face tensor name the converted checkpoint must hold."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.tie_word_embeddings:
            names.add("lm_head.weight")
        projections = ["q_proj", "k_proj", "v_proj", "o_proj"]
        biased = projections if self.model_type == "llama" else projections[:3]
        for layer in range(self.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            names |= {f"{prefix}.self_attn.{p}.weight" for p in projections}
            names |= {f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            names |= {
                f"{prefix}.input_layernorm.weight",
                f"{prefix}.post_attention_layernorm.weight",
            }
            if self.attention_bias or self.model_type == "qwen2":
                names |= {f"{prefix}.self_attn.{p}.bias" for p in biased}
        return names


def _refuse_unsupported(meta: GGUFMetadata, arch: str, tensor_names: Collection[str]) -> None:
    if meta.get_int(f"{arch}.expert_count", 0) > 0:
        raise ConfigError(
            f"this {arch} GGUF is a mixture-of-experts model, which minengine does not run"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError(
            "this GGUF scales RoPE with per-frequency factors (llama3-style rope_freqs), which "
            "import cannot turn back into config.json; convert from the original folder instead"
        )


def _linear_rope_factor(meta: GGUFMetadata, arch: str) -> float | None:
    kind = meta.get_str(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ConfigError(f"GGUF uses {kind!r} RoPE scaling; only linear scaling can be converted")
    return meta.get_float(f"{arch}.rope.scaling.factor")


def _one_or_many(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)
