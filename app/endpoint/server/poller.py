"""Reading the server's batch while one request runs: `/metrics` (and llama-server's `/slots`) at an interval.

The poll runs on the client's own event loop, beside the stream it must not delay: each answer
is read, filtered by name and parsed in a few milliseconds (`prometheus.read_metrics`), and the
interval (`--poll-ms`, 500 ms by default) keeps the server's share of work for it small. Each sample carries
its round trip, and the screen states the mean, so the cost of watching is always in sight.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from minengine.engine.timeline import Timeline
from reqscope.endpoint.server.llama import llama_batch_sample, parse_slots
from reqscope.endpoint.server.records import LLAMA_SERVER, SGLANG, VLLM, BatchSample, ServerKind, SlotState
from reqscope.endpoint.server.sglang import sglang_batch_sample
from reqscope.endpoint.server.vllm import vllm_batch_sample

_OFF = (404, 501)  # llama-server answers 501 to /metrics and /slots when started without the flag
_POLL_TIMEOUT = aiohttp.ClientTimeout(total=5)


def pollable(kind: ServerKind) -> bool:
    """Whether the client knows how to read this server's batch."""
    return kind.name in (VLLM, LLAMA_SERVER, SGLANG)


@dataclass
class BatchPoller:
    """Polls one server until cancelled, handing each sample to `put` as it arrives."""

    session: aiohttp.ClientSession
    kind: ServerKind
    headers: dict[str, str]
    timeline: Timeline  # the request's: each sample is stamped on the client's clock
    interval_ms: float
    put: Callable[[BatchSample], None]
    metrics_off: bool = False  # the server said /metrics is off
    slots_off: bool = False  # the server said /slots is off

    async def run(self) -> None:
        """Poll now, then every interval, until the task is cancelled."""
        while True:
            sample = await self.poll()
            if sample is not None:
                self.put(sample)
            if self.metrics_off and (self.kind.name != LLAMA_SERVER or self.slots_off):
                return  # nothing left to read
            await asyncio.sleep(self.interval_ms / 1000)

    async def poll(self) -> BatchSample | None:
        """One reading of the batch; None when the server answered nothing usable."""
        start = self.timeline.now_ms()
        if self.kind.name in (VLLM, SGLANG):
            text = await self._get("/metrics")
            end = self.timeline.now_ms()
            read = vllm_batch_sample if self.kind.name == VLLM else sglang_batch_sample
            return None if text is None else read(text, end, end - start)
        metrics, slots_body = await asyncio.gather(self._get("/metrics"), self._get("/slots"))
        end = self.timeline.now_ms()
        slots: tuple[SlotState, ...] = ()
        if slots_body is not None:
            try:
                slots = parse_slots(json.loads(slots_body))
            except json.JSONDecodeError:
                slots = ()
        if metrics is None and not slots:
            return None
        return llama_batch_sample(metrics, slots, end, end - start)

    async def _get(self, route: str) -> str | None:
        if (route == "/metrics" and self.metrics_off) or (route == "/slots" and self.slots_off):
            return None
        try:
            async with self.session.get(self.kind.root + route, headers=self.headers, timeout=_POLL_TIMEOUT) as resp:
                if resp.status in _OFF:
                    if route == "/metrics":
                        self.metrics_off = True
                    else:
                        self.slots_off = True
                    return None
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return None
