"""The KV cache a request gets: a block table over the engine's pool, or a buffer of its own."""

from __future__ import annotations

import torch

from minengine.config import ModelConfig
from minengine.kv.block_pool import BlockPool
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache


def request_cache(
    cfg: ModelConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    tokens: int,
    *,
    layout: str = "gqa",
    storage_dtype: torch.dtype | None = None,
    block_size: int = 16,
    pool: BlockPool | None = None,
    owner: str = "",
) -> KVCache | PagedKVCache:
    """A cache for `tokens` positions: a block table over `pool` for `owner` where there is a
    pool, else a buffer of its own; K/V stored in `storage_dtype` (default: the compute dtype)."""
    # The cache's own shape and storage: the same for a block table and a buffer of its own.
    kept = {"device": device, "compute_dtype": compute_dtype, "layout": layout,
            "storage_dtype": storage_dtype or compute_dtype, "block_size": block_size}  # fmt: skip
    if pool is not None:
        return PagedKVCache(pool, cfg, owner=owner, expect_tokens=tokens, **kept)
    return KVCache(cfg, tokens, **kept)
