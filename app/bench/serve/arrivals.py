"""When each request is sent: all at once, or at a request rate with Poisson (or burstier) arrivals.

As in vLLM's `get_request`: at an infinite rate every request is sent at once (a concurrency
cap, when set, then holds them back); otherwise the gaps between sends are drawn from a gamma
distribution whose mean is 1 / rate. Its shape is the burstiness: 1 gives exponential gaps, a
Poisson process; below 1 the sends bunch up, above 1 they even out.
"""

from __future__ import annotations

import math
import random


def send_offsets(count: int, request_rate: float, burstiness: float, seed: int) -> tuple[float, ...]:
    """Seconds from the start at which each of `count` requests is sent; the first at 0."""
    if math.isinf(request_rate):
        return (0.0,) * count
    rng = random.Random(f"arrivals-{seed}")  # apart from the prompts' generator: one does not shift the other
    scale = 1.0 / (request_rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return tuple(offsets)
