"""What a KV cache holds, as plain numbers, and the names of its layouts and storage dtypes.

Torch-free, so that whatever only reads or names a cache (events, the UI, a request's
validation, the endpoint client) does not load torch; `kv.cache` makes the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_LAYOUTS = ("gqa", "mha")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")
KV_DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}  # vLLM's name for the same storage


@dataclass(frozen=True)
class BlockSharing:
    """A paged cache's blocks by who else holds them, as the pool's reference counts say.

    Each block of the request's table is in exactly one group, so the three add up to the blocks
    it holds. A block another request holds too counts there even when the prefix cache also keeps it.
    """

    own: int  # held by this request alone
    with_requests: int  # also held by another request (the prefix cache may hold them too)
    with_prefix: int  # also held by the prefix cache, and by no other request
    block_bytes: int  # one block's K and V over every layer (FP8 scales included)

    @property
    def blocks(self) -> int:
        """Blocks the request holds, every group together."""
        return self.own + self.with_requests + self.with_prefix

    @property
    def own_bytes(self) -> int:
        """Bytes this request alone holds: what its release gives back, unless the prefix cache keeps them."""
        return self.own * self.block_bytes

    @property
    def with_requests_bytes(self) -> int:
        """Bytes held with other requests."""
        return self.with_requests * self.block_bytes

    @property
    def with_prefix_bytes(self) -> int:
        """Bytes held with the prefix cache alone."""
        return self.with_prefix * self.block_bytes


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of what the cache holds, in bytes (logical = tokens, physical = blocks).

    Logical bytes are the seeds' formula (tokens × bytes per token); physical bytes are the
    blocks the request holds, each in full, those it shares with others included (`sharing`
    says which).
    """

    layout: str
    dtype: str
    tokens: int
    block_size: int
    blocks: int
    layers: int
    stored_heads: int
    head_dim: int
    bytes_per_token: int  # logical K+V bytes per token, all layers
    logical_bytes: int
    physical_bytes: int  # whole blocks, plus FP8 scales where used
    reserved_bytes: int  # the buffer reserved for the request's budget
    per_layer_tokens: tuple[int, ...]
    per_layer_logical_bytes: tuple[int, ...]
    per_layer_physical_bytes: tuple[int, ...]
    # Who else holds the blocks: a paged cache's only (None for a request-owned buffer, which
    # shares nothing, and in traces recorded before it was kept).
    sharing: BlockSharing | None = None


@dataclass(frozen=True)
class PoolUsage:
    """The KV budget from one request's point of view (bytes), as a step found it.

    `own` is this request's cache, `others` the other running requests' caches, `prefix` the
    blocks the prefix cache keeps for later requests, and `free` what is left of the budget.
    The four add up to `budget`. A block two requests share counts as each one's own, and once
    in `others` for everyone else.
    """

    budget: int
    own: int
    others: int
    prefix: int

    @property
    def free(self) -> int:
        """Budget no one holds."""
        return max(0, self.budget - self.own - self.others - self.prefix)
