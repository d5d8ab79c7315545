"""Model configuration read from a Hugging Face `config.json`.

Only what changes results is kept, and anything this engine does not implement exactly is
refused with a ConfigError rather than silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minengine.errors import ConfigError, Setting

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projection bias (qwen2 always, llama optionally)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @property
    def q_per_kv(self) -> int:
        """Query heads that share one KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_kind(self) -> str:
        """'MHA', 'MQA' or 'GQA', by how query heads map onto KV heads."""
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        if self.num_key_value_heads == 1:
            return "MQA"
        return "GQA"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate and normalise a parsed config.json."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; reqscope runs {', '.join(SUPPORTED_MODEL_TYPES)} (point ",
                Setting.MODEL_DIR,
                " at one of those)",
            )
        for key in ("num_local_experts", "num_experts", "n_routed_experts", "kv_lora_rank"):
            if raw.get(key):
                raise ConfigError(
                    f"config.json sets {key}={raw[key]} (MoE or MLA), which minengine does not "
                    "implement; use a dense model"
                )
        try:
            hidden = int(raw["hidden_size"])
            n_heads = int(raw["num_attention_heads"])
            n_kv = int(raw.get("num_key_value_heads") or n_heads)
            head_dim = int(raw.get("head_dim") or hidden // n_heads)
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=n_kv,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(raw)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                rope_scaling=_rope_scaling(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json is missing {exc.args[0]!r}; is it a complete model config?") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has a malformed value: {exc}") from None
        cfg._check(raw)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}; ", Setting.MODEL_DIR, " must be a Hugging Face model folder")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} is not a JSON object")
        return cls.from_dict(raw)

    def _check(self, raw: dict[str, Any]) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        act = raw.get("hidden_act", "silu")
        if act not in _SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
        window = raw.get("sliding_window")
        use_window = raw.get("use_sliding_window", self.model_type == "mistral")
        if window and use_window and int(window) < self.max_position_embeddings:
            raise ConfigError(
                f"sliding-window attention (window {window}) is not implemented; results past "
                "the window would be wrong, so this model is refused"
            )
        layer_types = raw.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ConfigError("config.json mixes attention layer types; only full attention runs here")


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return raw.get("rope_theta", 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    spec = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not spec:
        return RopeScaling()
    rope_type = spec.get("rope_type") or spec.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling {rope_type!r} is not implemented (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); refusing rather than computing wrong positions"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(spec.get("factor", 1.0)),
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(spec.get("original_max_position_embeddings", 8192)),
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
