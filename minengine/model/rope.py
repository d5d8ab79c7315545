"""Rotary position embeddings in Hugging Face's `rotate_half` layout.

Angles are computed in float32 (as transformers does) and cached as cos/sin tables that grow
on demand, so a decode step only indexes rows instead of recomputing trigonometry.
"""

from __future__ import annotations

import torch

from minengine.config import ModelConfig
from minengine.reference.model import inverse_frequencies


class RotaryTable:
    """cos/sin lookup by absolute position, extended in chunks as sequences grow.

    Besides `cos`/`sin` it keeps `signed_sin`, sin with the first half negated: rotating by it
    needs only a swap of the two halves of x instead of building `rotate_half(x)`, which saves
    a negation and a concatenation per call on the decode hot path.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq = inverse_frequencies(cfg).to(device)
        self.dtype = dtype
        self.cos = torch.empty(0, cfg.head_dim, device=device, dtype=dtype)
        self.sin = torch.empty(0, cfg.head_dim, device=device, dtype=dtype)
        self.signed_sin = torch.empty(0, cfg.head_dim, device=device, dtype=dtype)

    @property
    def length(self) -> int:
        """Positions the tables cover now."""
        return self.cos.shape[0]

    def ensure(self, length: int) -> None:
        """Make the tables cover positions [0, length)."""
        if length <= self.cos.shape[0]:
            return
        length = max(length, 2 * self.cos.shape[0], 256)
        positions = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)
        half = self.sin.shape[-1] // 2
        self.signed_sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def lookup(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions [start, start+length), shaped [length, head_dim]."""
        self.ensure(start + length)
        return self.cos[start : start + length], self.sin[start : start + length]

    def lookup_signed(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [start, start+length), shaped [length, 1, head_dim] for `rotate`."""
        self.ensure(start + length)
        return self.cos[start : start + length, None], self.signed_sin[start : start + length, None]

    def lookup_signed_at(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each of `positions` (a shared step's decode rows), [len, 1, head_dim]
        and contiguous: one gather each, where a slice per row and a concatenation took 0.18 ms of an
        8-row step."""
        self.ensure(max(positions) + 1)
        at = torch.tensor(positions, device=self.cos.device)
        return self.cos[at, None], self.signed_sin[at, None]

