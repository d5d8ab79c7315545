"""The memory roofline of decode: bytes one step must read, and how fast this machine reads.

A batch-1 decode step multiplies one vector by every weight matrix and attends over every
cached position, so it must read all weights plus the K/V cache once; at that size arithmetic
is negligible and the read bandwidth sets the ceiling. `ReadProbe` measures that bandwidth on
the spot, one pass at a time (a large matrix-vector product in the engine's layout, and a plain
sum), so the benchmark can take its passes between decode steps and express a decode rate as
the fraction of the ceiling the machine offered at the same moments.
"""

from __future__ import annotations

import time

import torch

from minengine.device import synchronize

PROBE_BYTES = 512 * 1024 * 1024  # well past any CPU cache; ~0.1 ms of HBM on a large GPU
GPU_PROBE_BYTES = 4 * 1024 * 1024 * 1024


class ReadProbe:
    """A buffer of about `nbytes` (default: past any cache on `device`) streamed once per pass."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32, nbytes: int | None = None) -> None:
        if nbytes is None:
            nbytes = GPU_PROBE_BYTES if device.type == "cuda" else PROBE_BYTES
        self.device = device
        # The decode projections' access pattern: rows streamed, columns split one chunk per
        # thread (one chunk on a GPU), the chunks run together by bmm.
        chunks = torch.get_num_threads() if device.type == "cpu" else 1
        width = 1024 * chunks
        rows = max(1, nbytes // (width * torch.empty((), dtype=dtype).element_size()))
        self._matrix = torch.ones(chunks, rows, width // chunks, dtype=dtype, device=device)
        self._vector = torch.ones(1, 1, rows, dtype=dtype, device=device).expand(chunks, 1, rows)
        self.nbytes = self._matrix.numel() * self._matrix.element_size()
        self.matvec_seconds()  # first touch and kernel selection stay out of every timing
        self.sum_seconds()

    def matvec_seconds(self) -> float:
        """One pass as a vector times the [in, out] matrix, in seconds."""
        return self._timed(lambda: torch.bmm(self._vector, self._matrix))

    def sum_seconds(self) -> float:
        """One pass as a plain reduction, in seconds."""
        return self._timed(self._matrix.sum)

    def _timed(self, fn) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        fn()
        synchronize(self.device)
        return time.perf_counter() - start

    def release(self) -> None:
        """Hand the buffer back (on CUDA, to the device too) before anything else needs the memory."""
        del self._matrix, self._vector
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


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
