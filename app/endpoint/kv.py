"""The planner's KV figures for a model served elsewhere (`--base-url ... --card MODEL`).

An OpenAI-compatible endpoint does not expose its engine's cache, so per-layer KV cannot be
observed from the client. Given the model's shape (an architecture card name, a model folder or
a config.json), the planner computes what the cache logically holds for the request's token
counts instead; the output says it is computed, not measured.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from minengine.config import ModelConfig
from minengine.errors import ConfigError
from minengine.plan.cards import Architecture, load_cards
from minengine.plan.planner import DEFAULT_DTYPE, KV_DTYPES, Plan, PlanInputs, plan


def architecture_for(ref: str) -> Architecture:
    """A shipped card by name, or the shape a model folder's (or file's) config.json describes."""
    cards = load_cards(files("reqscope.cards"))
    if ref in cards:
        return cards[ref]
    path = Path(ref).expanduser()
    if path.exists():
        return Architecture.from_config(ModelConfig.from_file(path), name=path.resolve().name)
    raise ConfigError(f"--card {ref!r} is neither a card ({', '.join(cards)}) nor a model folder or config.json")


def planned_kv(arch: Architecture, prompt_tokens: int | None = None, output_tokens: int | None = None) -> Plan:
    """KV per token, for the prompt, and at the stop, for the counts known (the server's usage)."""
    kv_dtype = next((d for d in (arch.kv_dtype, arch.weight_dtype) if d in KV_DTYPES), DEFAULT_DTYPE)
    output = None if output_tokens is None else max(output_tokens, 1)
    inputs = PlanInputs(kv_dtype=kv_dtype, prompt_tokens=prompt_tokens, output_tokens=output)
    return plan(arch, inputs)
