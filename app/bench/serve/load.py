"""Drive the benchmark: every prompt sent at its offset, at most `max_concurrency` in flight.

The clock starts when the first request is due and stops when the last one has ended, so the
duration is the window every throughput divides by (a closed cohort: every request sent is
inside it). Warm-up requests go first, one at a time, and are not counted; their prompts are
their own, so no measured prompt finds itself in a server's prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from reqscope.bench.serve.prompts import BenchPrompt
from reqscope.bench.serve.stream import RequestOutcome, RequestTarget, send_request

Progress = Callable[[int, int], None]  # (requests ended, requests in all)


@dataclass(frozen=True)
class LoadPlan:
    """What to send, when, and how many at once."""

    target: RequestTarget
    prompts: tuple[BenchPrompt, ...]
    offsets_s: tuple[float, ...]  # when each prompt is sent, from the start
    max_concurrency: int | None = None  # None: no cap
    warmup_prompts: tuple[BenchPrompt, ...] = ()
    timeout_s: float = 600.0  # the longest wait for the next bytes of a response


@dataclass(frozen=True)
class LoadRun:
    """What the run measured: each request's outcome, in prompt order, and the window."""

    outcomes: tuple[RequestOutcome, ...]
    duration_s: float


async def drive(plan: LoadPlan, progress: Progress | None = None) -> LoadRun:
    """Send every prompt of `plan` and wait for all of them."""
    connector = aiohttp.TCPConnector(limit=plan.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=plan.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for prompt in plan.warmup_prompts:
            await send_request(session, plan.target, prompt)
        return await _measured(session, plan, progress)


async def _measured(session: aiohttp.ClientSession, plan: LoadPlan, progress: Progress | None) -> LoadRun:
    gate = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    total, ended = len(plan.prompts), 0

    async def one(prompt: BenchPrompt) -> RequestOutcome:
        nonlocal ended
        if gate is None:
            outcome = await send_request(session, plan.target, prompt)
        else:
            async with gate:
                outcome = await send_request(session, plan.target, prompt)
        ended += 1
        if progress is not None:
            progress(ended, total)
        return outcome

    if progress is not None:
        progress(0, total)
    start = time.perf_counter()
    tasks = []
    for prompt, offset in zip(plan.prompts, plan.offsets_s, strict=True):
        await _until(start + offset)
        tasks.append(asyncio.create_task(one(prompt)))
    outcomes = await asyncio.gather(*tasks)
    return LoadRun(tuple(outcomes), time.perf_counter() - start)


async def _until(moment: float) -> None:
    wait = moment - time.perf_counter()
    if wait > 0:
        await asyncio.sleep(wait)


def run_load(plan: LoadPlan, progress: Progress | None = None) -> LoadRun:
    """`drive` on an event loop of its own (the command line's entry)."""
    return asyncio.run(drive(plan, progress))
