"""Running a small block of work on one CPU thread."""

from __future__ import annotations

import torch


class OneThread:
    """Run a block on one intra-op thread (CPU only), then restore the thread count.

    Single-query attention is a handful of operations on a few kilobytes, yet its batched
    matmuls and softmax open parallel regions; waking the other threads for them costs more
    than the work (measured 115 us against 30 us per layer on 2 cores, most of it waiting).
    Switching the count costs about a microsecond.
    """

    __slots__ = ("threads",)

    def __init__(self, device: torch.device) -> None:
        self.threads = torch.get_num_threads() if device.type == "cpu" else 1

    def __enter__(self) -> None:
        if self.threads > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        if self.threads > 1:
            torch.set_num_threads(self.threads)
