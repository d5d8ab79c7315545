"""A shared step's records: one sequence's part of it (`Row`), who watches a row inside it, and
which decode rows attend together (`PoolGroup`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from minengine.kv.block_pool import Segment
from minengine.kv.cache import KVCache

if TYPE_CHECKING:
    from minengine.model.transformer import Transformer


class RowObserver(Protocol):
    """Shown what a row's last position does inside the step (`minengine.inspect.observer`).

    It is handed operands the step already has, and must leave them as they are."""

    def attended(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Layer `layer`'s query of the position, q [Hq, d], over keys [H stored, context, d]."""
        ...

    def residual(self, layer: int, x: torch.Tensor) -> None:
        """The position's residual stream [hidden] after block `layer`."""
        ...


@dataclass(frozen=True)
class Row:
    """One sequence's part of a step: its tokens at positions [start, start+len(ids)) into `cache`."""

    ids: tuple[int, ...]
    start: int
    cache: KVCache
    logits: bool  # whether the step returns next-token logits for its last position
    observer: RowObserver | None = None  # shown its last position's attention and residuals (with `logits`)

    def plain(self, model: Transformer) -> bool:
        """Whether this is a decode row whose cache stores K/V as `model` computes them, with room for it."""
        cache = self.cache
        return (
            len(self.ids) == 1 and not cache.quantized and cache.storage_dtype == model.dtype
            and cache.heads == model.cfg.num_key_value_heads and self.start < cache.capacity
        )  # fmt: skip



@dataclass(frozen=True)
class PoolGroup:
    """Decode rows of a step whose caches lie in one pool segment, attended together (`PooledRows`)."""

    segment: Segment
    rows: tuple[int, ...]  # their places among the step's rows, in order
    in_place: bool  # the C kernel reads the segment where it lies (else torch gathers the rows)
