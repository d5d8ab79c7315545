"""The weights' and compute's dtype names, as flags and model files spell them (no torch needed)."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's and transformers' other names
DTYPE_CHOICES = ("auto", *DTYPE_NAMES, *DTYPE_ALIASES)  # what --dtype accepts
