"""Rotary position embeddings in Hugging Face's `rotate_half` layout.

Angles are computed in float32 (as transformers does) and cached as cos/sin tables that grow
on demand, so a decode step only indexes rows instead of recomputing trigonometry.
"""

from __future__ import annotations

import math

import torch

from minengine.config import ModelConfig
from minengine.model.ops import c_rotate


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with the config's scaling applied (float32)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, s) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between them is blended smoothly so nearby positions stay distinguishable.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, head_dim] by the angles in cos/sin [T, head_dim] (Hugging Face's formula)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """`apply_rotary` for x [T, heads, head_dim] with tables from `RotaryTable.lookup_signed`.

    rotate_half(x) * sin equals swap_halves(x) * signed_sin exactly (negation is exact), so the
    result is bit for bit Hugging Face's. (`addcmul` would save an operation but its fused
    multiply-add rounds differently.) A decode step passes `out` and `scratch` (both shaped
    like x): the same three operations then write into them instead of allocating.
    """
    y = c_rotate(x, cos, signed_sin, out)  # the same arithmetic in one C call, on the CPU in float32
    if y is not None:
        return y
    swapped = x.roll(x.shape[-1] // 2, dims=-1)
    if out is None:
        return x * cos + swapped * signed_sin
    torch.mul(x, cos, out=out)
    return out.add_(torch.mul(swapped, signed_sin, out=scratch))
