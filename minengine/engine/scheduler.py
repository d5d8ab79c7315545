"""Admission control: a token budget and a KV-memory budget, with a waiting queue.

A request is admitted when its prompt plus max_tokens fits the context, its worst-case KV
(block-rounded) fits beside the KV already held by running requests and, when a limit on
running requests is set, a running slot is free. If it could fit once others finish, it waits
(the wait is part of its TTFT); if it could never fit, it is rejected with the numbers; if the
queue is already full, it is refused with QueueFullError. The queue is first come, first
served: a request is admitted only from the head of the queue, so a later small request never
overtakes an earlier one that waits for room (vLLM's FCFS policy).

Memory kept between requests (the prefix cache's blocks) counts against the same budget. It is
never a reason to wait: an admission that fits beside the running requests but not beside the
kept blocks evicts them first (`KeptMemory.evict`, least recently used first), and what may be
kept is decided under the same lock (`within_budget`), so the running reservations plus the
kept bytes never exceed the budget.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from minengine.errors import AdmissionError, QueueCancelledError, QueueFullError, Setting
from minengine.kv.arithmetic import MIB

R = TypeVar("R")


class KeptMemory(Protocol):
    """Memory kept between requests inside the KV budget, given back on demand (the prefix cache)."""

    @property
    def kept_bytes(self) -> int:
        """Bytes kept now."""
        ...

    def evict(self, nbytes: int) -> int:
        """Free at least `nbytes` if it can; the bytes freed."""
        ...


@dataclass(frozen=True)
class Admission:
    """A granted reservation; hand it back with `Scheduler.release`."""

    request_id: str
    kv_bytes: int
    queue_ms: float


class Scheduler:
    """Grants KV reservations against a byte budget; thread-safe."""

    def __init__(self, kv_budget_bytes: int, max_queue: int = 16, max_running: int | None = None) -> None:
        self.kv_budget_bytes = kv_budget_bytes
        self.max_queue = max_queue
        self.max_running = max_running  # None: only the KV budget limits running requests
        self._held = 0
        self._running = 0
        self._queue: deque[object] = deque()  # one ticket per waiting request, in arrival order
        self._cond = threading.Condition()

    @property
    def held_bytes(self) -> int:
        """KV bytes reserved by running requests."""
        return self._held

    @property
    def running(self) -> int:
        """Requests admitted and not yet released."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests waiting in the queue for admission."""
        return len(self._queue)

    def _must_wait(self, kv_bytes: int, kept: KeptMemory | None = None) -> bool:
        slots_full = self.max_running is not None and self._running >= self.max_running
        over = self._held + kv_bytes - self.kv_budget_bytes
        if slots_full or over > 0:
            return True  # only running requests can make room: keep the kept blocks meanwhile
        if kept is not None:
            over += kept.kept_bytes
            if over > 0:
                over -= kept.evict(over)
        return over > 0

    def admit(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        context_limit: int,
        kv_bytes: int,
        timeout_s: float | None = None,
        cancelled: threading.Event | None = None,
        kept: KeptMemory | None = None,
    ) -> Admission:
        """Reserve `kv_bytes` for a request, waiting while others hold the budget.

        Memory `kept` between requests (the prefix cache) is evicted as far as the reservation
        needs the room.
        """
        if prompt_tokens >= context_limit:  # no max_tokens can help: the prompt must shrink
            raise AdmissionError(
                f"the prompt alone is {prompt_tokens} tokens, and the model's context holds {context_limit} "
                "(with room for one output token); shorten the prompt or the system prompt"
            )
        if prompt_tokens + max_tokens > context_limit:
            raise AdmissionError(
                f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
                f"tokens exceeds the model's context of {context_limit}; lower ",
                Setting.MAX_TOKENS,
            )
        if kv_bytes > self.kv_budget_bytes:
            raise AdmissionError(
                f"needs {kv_bytes / MIB:.1f} MiB of KV, budget {self.kv_budget_bytes / MIB:.1f} MiB; lower ",
                Setting.MAX_TOKENS,
                " or raise ",
                Setting.KV_BUDGET,
            )
        start = time.perf_counter()
        with self._cond:
            if (self._queue or self._must_wait(kv_bytes, kept)) and len(self._queue) >= self.max_queue:
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting); try again later")
            ticket = object()
            self._queue.append(ticket)
            try:
                while self._queue[0] is not ticket or self._must_wait(kv_bytes, kept):
                    if cancelled is not None and cancelled.is_set():
                        waited_ms = (time.perf_counter() - start) * 1000
                        raise QueueCancelledError("cancelled while waiting in the queue", waited_ms)
                    left = None if timeout_s is None else timeout_s - (time.perf_counter() - start)
                    if left is not None and left <= 0:
                        raise AdmissionError(
                            f"waited {timeout_s:.1f} s in the queue for {kv_bytes / MIB:.1f} MiB of KV; try again later"
                        )
                    self._cond.wait(timeout=0.05 if left is None else min(left, 0.05))
                self._held += kv_bytes
                self._running += 1
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may fit too
        return Admission(request_id, kv_bytes, (time.perf_counter() - start) * 1000)

    def within_budget(self, keep: Callable[[int], R], *, releasing: Admission | None = None) -> R:
        """`keep(room)` under the admission lock, where room is what memory kept between
        requests may hold in all now: the budget less the running reservations, not counting
        `releasing` (the caller's own, about to be returned: what it keeps is copied from the
        cache that reservation paid for, which is freed next)."""
        with self._cond:
            mine = releasing.kv_bytes if releasing is not None else 0
            return keep(self.kv_budget_bytes - self._held + mine)

    def release(self, admission: Admission) -> None:
        """Return a reservation and wake waiting requests."""
        with self._cond:
            self._held -= admission.kv_bytes
            self._running -= 1
            self._cond.notify_all()
