"""The weights' and compute's dtype names, as flags and model files spell them (no torch needed)."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's and transformers' other names
DTYPE_CHOICES = ("auto", *DTYPE_NAMES, *DTYPE_ALIASES)  # what --dtype accepts

# The projections' storage, llama.cpp's and vLLM's short names (`--outtype f16`, `--kv-cache-dtype
# fp8`): float32 as --dtype spells it, fp16, bf16, int8 (8-bit weights, per output channel).
WEIGHT_FORMATS = ("float32", "fp16", "bf16", "int8", "q8_0", "q4_1")
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)  # what --weights accepts
