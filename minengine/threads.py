"""Which threads run model work: a small block on one CPU thread (`OneThread`), and all of a
process's model work on one long-lived thread (`ModelThread`, the process's: `model_thread`), a
`SerialThread` (callables in order on one daemon thread) whose one job is the model's."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
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


class SerialThread:
    """One daemon thread that runs the callables handed to it, one at a time, in the order they came.

    Work runs in submission order, so work queued behind a cancelled run starts when that one has
    returned. The thread never holds the process open at exit: what it runs ends with the process.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., object], tuple] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the future carries it to whoever waits
                future.set_exception(exc)
            del future, fn, args, item  # nothing of a finished run stays referenced while idle

    def here(self) -> bool:
        """Whether the calling thread is this one."""
        return threading.current_thread() is self._thread

    def others_waiting(self) -> bool:
        """Whether work is queued behind what the thread runs now."""
        return not self._queue.empty()

    def submit(self, fn: Callable[..., T], /, *args: object) -> Future[T]:
        """Queue `fn(*args)` on the thread; its future carries the result or the exception."""
        if self._closed:
            raise RuntimeError(f"the thread {self._thread.name} was shut down")
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Take no more work; what is queued still runs (cancel a run first to end it)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)


class ModelThread(SerialThread):
    """The process's model thread: every engine's loading and every step (prefill, decode, a
    held step's inspection) run on it, whichever threads the requests come from.

    GNU OpenMP gives every thread that opens a parallel region a team of its own and counts the
    workers of all teams; once they outnumber the CPUs, workers spin only 1,000 times (its
    "throttled" spin count) instead of GOMP_SPINCOUNT before they sleep. A host that loads the
    model on one thread and decodes on another leaves two teams behind, and every parallel region
    of a step then wakes a sleeping worker: the explorer, whose loader and runs landed on
    different pool threads in most launches, paid thousands of context switches per 128 tokens
    and decoded markedly slower than when one thread did everything (docs/openmp-wait-policy.md,
    "What `reqscope` does", has the figures). One thread for all model work keeps one team.
    """

    def call(self, fn: Callable[..., T], /, *args: object) -> T:
        """`fn(*args)` on the thread, waited for (at once when called there), with the caller's
        intra-op thread count: a count set on another thread is that thread's alone."""
        if self.here():
            return fn(*args)
        count = torch.get_num_threads()

        def run() -> T:
            if torch.get_num_threads() != count:
                torch.set_num_threads(count)
            return fn(*args)

        return self.submit(run).result()


_process_thread: ModelThread | None = None
_process_lock = threading.Lock()


def model_thread() -> ModelThread:
    """The process's model thread: every engine loads its model and runs its steps on it, so that
    all the process's OpenMP work has one team (`ModelThread` says why), whichever threads the
    requests come from."""
    global _process_thread
    with _process_lock:
        if _process_thread is None:
            _process_thread = ModelThread("minengine-steps")
        return _process_thread
