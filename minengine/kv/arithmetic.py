"""The KV-cache size formula, in one place.

For standard MHA/GQA/MQA storage each layer keeps one K and one V vector per KV head per token:

    kv_bytes_per_token = 2 x layers x kv_heads x head_dim x bytes_per_element

Query heads never enter it: substituting them overstates a GQA model's cache by
q_heads / kv_heads. Layouts that retain other state (MLA latents, sliding windows,
recurrent/hybrid layers) need their own formula and are refused by the planner.
"""

from __future__ import annotations

MIB = 2**20
GIB = 2**30
KIB = 2**10

# Bytes per stored element, by the KV dtype names used across the CLI and config files.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: float) -> int:
    """Logical K+V bytes one token occupies across all layers."""
    return int(2 * layers * kv_heads * head_dim * bytes_per_element)


def kv_bytes(
    layers: int, kv_heads: int, head_dim: int, bytes_per_element: float, tokens: int
) -> int:
    """Logical K+V bytes for `tokens` cached positions."""
    return kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_element) * tokens


def blocks_for(tokens: int, block_size: int) -> int:
    """Whole blocks needed to hold `tokens` positions (physical allocation unit)."""
    return -(-tokens // block_size)


def stored_kv_heads(layout: str, q_heads: int, kv_heads: int) -> int:
    """KV heads a cache stores per layer: the model's own for `gqa`, one per query head for `mha`."""
    return q_heads if layout == "mha" else kv_heads


def kv_bytes_in_blocks(
    layers: int, kv_heads: int, head_dim: int, bytes_per_element: float, tokens: int, block_size: int
) -> int:
    """K+V bytes of the whole `block_size`-token blocks that hold `tokens` positions.

    This is the worst case a request is admitted against: a block is allocated whole, so a
    request that stops partway through its last block still holds all of it. Like `kv_bytes`
    it counts the logical payload only (no FP8 scales).
    """
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_element)
    return blocks_for(tokens, block_size) * block_size * per_token
