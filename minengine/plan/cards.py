"""Architecture cards: small JSON files describing a model's shape for the planner.

A card holds only what the memory and latency arithmetic needs, plus a `source` note saying
where the numbers come from:

    {"name": "llama-3.1-8b", "source": "...", "attention": "gqa", "layers": 32,
     "q_heads": 32, "kv_heads": 8, "head_dim": 128, "params": 8.03e9}

Optional keys: `kv_dtype` and `weight_dtype` (defaults for the planner) and `note`.
`attention` is one of STANDARD_ATTENTION (the KV formula applies) or NONSTANDARD_ATTENTION
(the card exists so the planner can refuse it by name).

This module reads cards from a directory it is given; it does not know where the installed
cards live, which keeps minengine free of the UI package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import Any

from minengine.config import ModelConfig
from minengine.errors import ConfigError

# Layouts that store exactly one K and one V vector per KV head per token in every layer.
STANDARD_ATTENTION = ("mha", "gqa", "mqa")
# Layouts whose retained state needs its own formula; each value says why.
NONSTANDARD_ATTENTION: dict[str, str] = {
    "mla": "caches one compressed latent (plus a shared RoPE key) per token, not K and V "
    "per KV head",
    "sliding_window": "keeps only the last `window` tokens in (some) layers, so the cache stops "
    "growing with the sequence",
    "hybrid_recurrent": "mixes attention with recurrent/state-space layers whose state has a "
    "fixed size per sequence, not per token",
}


@dataclass(frozen=True)
class Architecture:
    """Shape of a decoder-only model as the planner sees it.

    `params` is the total parameter count (all experts for MoE models), or None if unknown.
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float | None = None
    attention: str = "gqa"
    source: str = ""
    note: str = ""
    kv_dtype: str | None = None
    weight_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.attention not in STANDARD_ATTENTION and self.attention not in (
            NONSTANDARD_ATTENTION
        ):
            known = ", ".join((*STANDARD_ATTENTION, *NONSTANDARD_ATTENTION))
            raise ConfigError(f"{self.name}: attention {self.attention!r} unknown (one of {known})")
        for field_name in ("layers", "q_heads", "kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{self.name}: {field_name} must be a positive integer, got {value!r}"
                )
        if self.q_heads % self.kv_heads:
            raise ConfigError(
                f"{self.name}: {self.q_heads} query heads cannot be split evenly over "
                f"{self.kv_heads} KV heads"
            )
        if self.params is not None and not self.params > 0:
            raise ConfigError(f"{self.name}: params must be positive, got {self.params}")

    @property
    def kv_formula_applies(self) -> bool:
        """True when the retained state is one K and one V vector per KV head per token."""
        return self.attention in STANDARD_ATTENTION

    @property
    def layout(self) -> str:
        """'MHA', 'GQA' or 'MQA' by head counts, or the nonstandard attention name."""
        if not self.kv_formula_applies:
            return self.attention.upper().replace("_", "-")
        if self.kv_heads == self.q_heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    @classmethod
    def from_card(cls, raw: Any, origin: str) -> Architecture:
        """Build from a parsed card; `origin` names the card in error messages."""
        if not isinstance(raw, dict):
            raise ConfigError(f"card {origin} is not a JSON object")
        try:
            return cls(
                name=str(raw["name"]),
                layers=raw["layers"],
                q_heads=raw["q_heads"],
                kv_heads=raw["kv_heads"],
                head_dim=raw["head_dim"],
                params=None if raw.get("params") is None else float(raw["params"]),
                attention=str(raw.get("attention", "gqa")),
                source=str(raw.get("source", "")),
                note=str(raw.get("note", "")),
                kv_dtype=raw.get("kv_dtype"),
                weight_dtype=raw.get("weight_dtype"),
            )
        except KeyError as exc:
            raise ConfigError(f"card {origin} lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"card {origin} has a malformed value: {exc}") from None

    @classmethod
    def from_config(cls, config: ModelConfig, name: str) -> Architecture:
        """Shape of a model whose config.json ModelConfig accepted (dense, full attention)."""
        return cls(
            name=name,
            layers=config.num_hidden_layers,
            q_heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            params=float(dense_param_count(config)),
            attention="gqa",
            source="config.json; params counted from its shapes",
            weight_dtype=config.torch_dtype,
        )


def dense_param_count(config: ModelConfig) -> int:
    """Exact parameter count of the dense llama-family layout ModelConfig describes."""
    hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.attention_bias:
        attention += q_width + 2 * kv_width
    mlp = 3 * hidden * config.intermediate_size
    if config.mlp_bias:
        mlp += 2 * config.intermediate_size + hidden
    norms = 2 * hidden + (2 * config.head_dim if config.qk_norm else 0)
    embeddings = config.vocab_size * hidden
    lm_head = 0 if config.tie_word_embeddings else embeddings
    return config.num_hidden_layers * (attention + mlp + norms) + hidden + embeddings + lm_head


def load_cards(directory: Traversable) -> dict[str, Architecture]:
    """Every `*.json` card in a directory, by name."""
    cards: dict[str, Architecture] = {}
    for entry in sorted(directory.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".json"):
            continue
        try:
            raw = json.loads(entry.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read card {entry.name}: {exc}") from None
        card = Architecture.from_card(raw, entry.name)
        if card.name in cards:
            raise ConfigError(f"two cards are named {card.name!r}")
        cards[card.name] = card
    return cards
