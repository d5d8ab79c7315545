"""A burst at the server's defaults: 200 streaming requests sent at once are all served.

As vLLM does, `reqscope serve` admits by capacity (as many running as the KV pool holds and a
step's token budget gives a token each), queues the rest in a queue bounded by memory, and limits
no client's rate unless asked: a load tool's burst is served, not refused. Afterwards every block
is back, nothing runs or waits, and identical requests got identical tokens whatever step they
shared.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
from serve_harness import chat_body, serving

from minengine.engine.engine import Engine
from minengine.kv.arithmetic import MIB
from reqscope.serve.app import memory_queue_bound
from reqscope.serve.gateway import GatewayConfig

BURST = 200
PROMPTS = ("Hello there", "Show me wheelchair-accessible hotels in Kyoto", "What is a KV cache?", "Write a haiku")


async def _send_all(url: str) -> list[tuple[int, str, int]]:
    """Every request at once: (status, streamed text, the most sequences its steps shared)."""

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str, int]:
        body = chat_body(PROMPTS[i % len(PROMPTS)], max_tokens=6, temperature=0, stream=True)
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                return resp.status, await resp.text(), 0
            text, widest = "", 0
            async for line in resp.content:
                data = line.decode().strip().removeprefix("data: ")
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                for choice in chunk.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
                batch = (chunk.get("reqscope") or {}).get("batch") or {}
                widest = max(widest, batch.get("max_batch", 0))
            return resp.status, text, widest

    connector = aiohttp.TCPConnector(limit=0)  # one connection a request, all at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(BURST)))


def test_two_hundred_at_once_at_the_defaults_are_all_served(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 * MIB)
    assert engine.steps.limits.max_num_seqs == 64  # by capacity: the CPU step's 64 tokens, one each
    threads = threading.active_count()
    with serving(engine, GatewayConfig()) as served:  # no key, and every other setting the default
        assert engine.scheduler.max_queue == memory_queue_bound(engine) >= BURST
        results = asyncio.run(_send_all(served.url))
    statuses = [status for status, _, _ in results]
    assert statuses.count(200) == BURST, {s: statuses.count(s) for s in set(statuses)}
    by_prompt: dict[str, set[str]] = {}
    for i, (_, text, _) in enumerate(results):
        by_prompt.setdefault(PROMPTS[i % len(PROMPTS)], set()).add(text)
    assert all(len(texts) == 1 and "" not in texts for texts in by_prompt.values()), by_prompt  # batch-invariant
    assert max(widest for _, _, widest in results) > 8  # more than the old fixed 8 slots ran together
    assert engine.scheduler.running == 0 and engine.scheduler.waiting == 0
    assert engine.pool.request_bytes == 0  # every request's blocks are back in the pool
    assert threading.active_count() <= threads + 2
