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

from minengine.config import ModelConfig, RopeScaling
from minengine.errors import ConfigError, Setting, WeightsError
from minengine.gguf.metadata import GGUFMetadata

# general.architecture -> (config.json model_type, architectures entry)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}


@dataclass(frozen=True)
class GGUFHyperParams:
    """What config.json needs, read from GGUF metadata and the list of tensor names.

    `config` is the architecture as the engine will read it back from the converted folder;
    GGUF names the architecture itself and adds the padding id.
    """

    architecture: str
    config: ModelConfig
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
        config = ModelConfig(
            model_type=SUPPORTED_ARCHITECTURES[arch][0],
            vocab_size=embedding[0],
            hidden_size=hidden,
            intermediate_size=meta.get_int(f"{arch}.feed_forward_length"),
            num_hidden_layers=meta.get_int(f"{arch}.block_count"),
            num_attention_heads=n_heads,
            num_key_value_heads=meta.get_int(f"{arch}.attention.head_count_kv", n_heads),
            head_dim=head_dim,
            rms_norm_eps=meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=meta.get_float(f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=_rope_scaling(meta, arch),
            max_position_embeddings=meta.get_int(f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias="blk.0.attn_q.bias" in tensor_shapes,
            bos_token_id=meta.get_int("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        )
        return cls(arch, config, pad_token_id=meta.get_int("tokenizer.ggml.padding_token_id", None))

    def hf_config(self, torch_dtype: str) -> dict[str, Any]:
        """The content of config.json for this model, weights stored as `torch_dtype`."""
        cfg = self.config
        class_name = SUPPORTED_ARCHITECTURES[self.architecture][1]
        rope = cfg.rope_scaling
        config: dict[str, Any] = {
            "architectures": [class_name],
            "model_type": cfg.model_type,
            "hidden_act": "silu",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": (
                {"rope_type": rope.rope_type, "factor": rope.factor} if rope.rope_type == "linear" else None
            ),
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": _one_or_many(cfg.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
            "torch_dtype": torch_dtype,
        }
        if cfg.model_type == "llama":
            config |= {"attention_bias": cfg.attention_bias, "mlp_bias": False}
        else:
            # Qwen2 always has q/k/v biases; its sliding window is off in every released model.
            config |= {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": cfg.num_hidden_layers,
            }
        return config

    def generation_config(self) -> dict[str, Any]:
        """The content of generation_config.json: the ids that end a reply."""
        return {
            "bos_token_id": self.config.bos_token_id,
            "eos_token_id": _one_or_many(self.config.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }

    def expected_tensors(self) -> set[str]:
        """Every Hugging Face tensor name the converted checkpoint must hold."""
        cfg = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        projections = ["q_proj", "k_proj", "v_proj", "o_proj"]
        biased = projections if cfg.model_type == "llama" else projections[:3]
        for layer in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            names |= {f"{prefix}.self_attn.{p}.weight" for p in projections}
            names |= {f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            names |= {
                f"{prefix}.input_layernorm.weight",
                f"{prefix}.post_attention_layernorm.weight",
            }
            if cfg.attention_bias or cfg.model_type == "qwen2":
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


def _rope_scaling(meta: GGUFMetadata, arch: str) -> RopeScaling:
    kind = meta.get_str(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind != "linear":
        raise ConfigError(f"GGUF uses {kind!r} RoPE scaling; only linear scaling can be converted")
    factor = meta.get_float(f"{arch}.rope.scaling.factor")
    return RopeScaling(rope_type="linear", factor=factor) if factor else RopeScaling()


def _one_or_many(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)
