"""Requests run at once on one engine, each on a thread of its own (as a server runs them)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.engine.session import RequestSession


def run_all(
    engine: Engine,
    requests: list[GenerationRequest],
    timeout_s: float = 300,
    prepare: Callable[[RequestSession], None] | None = None,
    steered: bool = True,
) -> list[list]:
    """Every request's events, the requests started together (a barrier) on threads of their own;
    `prepare` is handed each session before it runs; `steered=False` runs them as a server does."""
    events: list[list] = [[] for _ in requests]
    start = threading.Barrier(len(requests))

    def run(i: int) -> None:
        session = engine.start(requests[i], steered=steered)
        if prepare is not None:
            prepare(session)
        start.wait()
        events[i] = list(session)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return events
