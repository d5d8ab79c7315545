"""Which threads run model work: a small block on one CPU thread (`OneThread`), and all of a
process's model work on one long-lived thread (`ModelThread`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


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


class ModelThread:
    """One long-lived thread for all of a process's model work: loading, prefill and decode.

    GNU OpenMP gives every thread that opens a parallel region a team of its own and counts the
    workers of all teams; once they outnumber the CPUs, workers spin only 1,000 times (its
    "throttled" spin count) instead of GOMP_SPINCOUNT before they sleep. A host that loads the
    model on one thread and decodes on another leaves two teams behind, and every parallel region
    of a step then wakes a sleeping worker: the explorer, whose loader and runs landed on
    different pool threads in most launches, paid about 15,000 context switches per 128 tokens
    and decoded at 40 tok/s against 55 when one thread did everything (2 cores).

    Work runs in submission order, so a new run queued behind a cancelled one starts when that
    one has returned.
    """

    def __init__(self, name: str = "reqscope-model") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], /, *args: object) -> Future[T]:
        """Queue `fn(*args)` on the thread; its future carries the result or the exception."""
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., T], /, *args: object) -> T:
        """Await `fn(*args)` run on the thread (from an asyncio event loop)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Take no more work; what is queued still runs (cancel a run first to end it)."""
        self._executor.shutdown(wait=False)
