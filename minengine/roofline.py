"""The memory roofline of decode: bytes one step must read, and how fast this machine reads.

A batch-1 decode step multiplies one vector by every weight matrix and attends over every
cached position, so it must read all weights plus the K/V cache once; at that size arithmetic
is negligible and the read bandwidth sets the ceiling. `probe_read_bandwidth` measures that
bandwidth on the spot (a large matrix-vector product in the engine's layout, and a plain sum),
so a decode rate can be expressed as the fraction of the ceiling it reaches on this machine now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minengine.device import synchronize

PROBE_BYTES = 512 * 1024 * 1024  # well past any CPU cache; ~0.1 ms of HBM on a large GPU
GPU_PROBE_BYTES = 4 * 1024 * 1024 * 1024


@dataclass(frozen=True)
class BandwidthProbe:
    """Read bandwidth measured two ways, in bytes per second (best of the repeats)."""

    matvec: float  # a vector times an [in, out] matrix split in one column chunk per thread
    sum: float  # a plain reduction over the same bytes

    @property
    def peak(self) -> float:
        """The better of the two: the fastest streaming read observed."""
        return max(self.matvec, self.sum)


def probe_read_bandwidth(
    device: torch.device, dtype: torch.dtype = torch.float32, nbytes: int | None = None, repeats: int = 5
) -> BandwidthProbe:
    """Measure how fast `device` streams `nbytes` of `dtype` from memory."""
    if nbytes is None:
        nbytes = GPU_PROBE_BYTES if device.type == "cuda" else PROBE_BYTES
    probe = _probe(device, dtype, nbytes, repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the probe's gigabytes back before the engines run
    return probe


def _probe(device: torch.device, dtype: torch.dtype, nbytes: int, repeats: int) -> BandwidthProbe:
    # The decode projections' access pattern: rows streamed, columns split one chunk per thread
    # (one chunk on a GPU), the chunks run together by bmm.
    chunks = torch.get_num_threads() if device.type == "cpu" else 1
    width = 1024 * chunks
    rows = max(1, nbytes // (width * torch.empty((), dtype=dtype).element_size()))
    matrix = torch.ones(chunks, rows, width // chunks, dtype=dtype, device=device)
    vector = torch.ones(1, 1, rows, dtype=dtype, device=device).expand(chunks, 1, rows)
    real_bytes = matrix.numel() * matrix.element_size()
    matvec = _best_rate(lambda: torch.bmm(vector, matrix), real_bytes, device, repeats)
    total = _best_rate(lambda: matrix.sum(), real_bytes, device, repeats)
    return BandwidthProbe(matvec=matvec, sum=total)


def _best_rate(fn, nbytes: int, device: torch.device, repeats: int) -> float:
    fn()  # first touch and kernel selection stay out of the timing
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def decode_bytes_per_step(weight_bytes: int, kv_bytes_per_token: int, prompt_tokens: int, steps: int) -> float:
    """Average bytes one of `steps` decode steps after a `prompt_tokens` prompt must read.

    Each step reads all weights, and the K/V of every position up to and including its own:
    step k (from 0) attends over prompt_tokens + k + 1 positions.
    """
    mean_positions = prompt_tokens + (steps + 1) / 2
    return weight_bytes + kv_bytes_per_token * mean_positions


def achieved_bandwidth(bytes_per_step: float, steps_per_second: float) -> float:
    """Bytes per second a decode loop reads at `steps_per_second`."""
    return bytes_per_step * steps_per_second


def roofline_fraction(achieved: float, peak: float) -> float:
    """Achieved bandwidth as a fraction of the measured peak."""
    if peak <= 0:
        raise ValueError("peak bandwidth must be positive")
    return achieved / peak


def roofline_tokens_per_second(bytes_per_step: float, peak: float) -> float:
    """The decode rate the measured bandwidth would allow if reading were all a step did."""
    return peak / bytes_per_step
