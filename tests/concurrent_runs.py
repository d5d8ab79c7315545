"""Requests run at once on one engine, each on a thread of its own (as a server runs them)."""

from __future__ import annotations

import threading

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest


def run_all(engine: Engine, requests: list[GenerationRequest], timeout_s: float = 300) -> list[list]:
    """Every request's events, the requests started together (a barrier) on threads of their own."""
    events: list[list] = [[] for _ in requests]
    start = threading.Barrier(len(requests))

    def run(i: int) -> None:
        start.wait()
        events[i] = list(engine.start(requests[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return events
