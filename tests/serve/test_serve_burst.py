"""A burst at the server's defaults: 200 streaming requests sent at once are all served.

As vLLM does, `reqscope serve` admits by capacity (as many running as the KV pool holds and a
step's token budget gives a token each), queues the rest in a queue bounded by memory, and limits
no client's rate unless asked: a load tool's burst is served, not refused.

The burst is sent twice, each time checked in full:

- nothing lost: every request is answered 200, and every stream ends with its finish chunk
  (finish_reason "length", the `reqscope` report), its usage (all its max_tokens) and [DONE];
  the server recorded each request once;
- nothing mixed between requests: every chunk of a stream carries its own request's ID, its
  report names its own request, and its text equals the same request run alone before the burst
  (eight specs: four prompts, each greedy and with seeded sampling, whose solo texts all differ,
  so a token from another request's stream would show);
- every block back in the pool: nothing runs or waits, no request holds a block, and what the
  pool still holds is the prefix cache's alone;
- threads, file descriptors and RSS flat: the second burst leaves them within `footprint`'s
  slack of where the first left them (the first is the warm-up: what the process keeps once it
  has run 64 sequences at once is in that baseline).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass

import aiohttp
from footprint import wait_until_idle, workers
from serve_harness import chat_body, serving

from minengine.engine.engine import Engine
from minengine.engine.step_loop import default_token_budget
from minengine.kv.arithmetic import MIB
from reqscope.serve.app import memory_queue_bound
from reqscope.serve.gateway import GatewayConfig

BURST = 200
MAX_TOKENS = 12
PROMPTS = ("Hello there", "Show me wheelchair-accessible hotels in Kyoto", "What is a KV cache?", "Write a haiku")
# Each prompt greedy, and sampled with a seed of its own: eight distinct requests, repeated.
SPECS = tuple((prompt, 0.0, None) for prompt in PROMPTS) + tuple(
    (prompt, 0.8, 100 + i) for i, prompt in enumerate(PROMPTS)
)


def _body(spec: int) -> dict:
    prompt, temperature, seed = SPECS[spec]
    seeded = {} if seed is None else {"seed": seed}
    return chat_body(prompt, max_tokens=MAX_TOKENS, temperature=temperature, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True}, **seeded)  # fmt: skip


@dataclass(frozen=True)
class Streamed:
    """What one client saw."""

    request_id: str
    spec: int
    status: int
    payloads: tuple[str, ...]  # the stream's SSE data, in order (a refusal's body, when not 200)

    @property
    def chunks(self) -> list[dict]:
        return [json.loads(p) for p in self.payloads if p.startswith("{")]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c["choices"])

    @property
    def widest(self) -> int:
        """The most sequences its steps shared (its report's batch facts)."""
        report = next((c["reqscope"] for c in self.chunks if c.get("reqscope")), {})
        return (report.get("batch") or {}).get("max_batch", 0)


async def _send_all(url: str, name: str, specs: list[int]) -> list[Streamed]:
    """A request of each of `specs` (indices into SPECS), all at once, the i-th named `{name}-{i}`."""

    async def one(session: aiohttp.ClientSession, i: int, spec: int) -> Streamed:
        request_id = f"{name}-{i:03d}"
        headers = {"x-request-id": request_id}
        async with session.post(f"{url}/v1/chat/completions", json=_body(spec), headers=headers) as resp:
            if resp.status != 200:
                return Streamed(request_id, spec, resp.status, (await resp.text(),))
            payloads = []
            async for line in resp.content:
                data = line.decode().strip()
                if data.startswith("data: "):
                    payloads.append(data.removeprefix("data: "))
            return Streamed(request_id, spec, resp.status, tuple(payloads))

    connector = aiohttp.TCPConnector(limit=0)  # one connection a request, all at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one(session, i, spec) for i, spec in enumerate(specs)))


def _check(streams: list[Streamed], solo: list[str], served) -> None:
    """Nothing lost and nothing mixed, stream by stream."""
    statuses = Counter(s.status for s in streams)
    assert statuses == {200: len(streams)}, statuses
    for s in streams:
        assert s.payloads[-1] == "[DONE]", s.request_id
        chunks = s.chunks
        assert {c["id"] for c in chunks} == {f"chatcmpl-{s.request_id}"}, s.request_id  # its own chunks only
        finish, usage = chunks[-2], chunks[-1]
        assert finish["choices"][0]["finish_reason"] == "length", s.request_id
        assert finish["reqscope"]["request_id"] == s.request_id
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == MAX_TOKENS, s.request_id
        assert s.text == solo[s.spec], (s.request_id, s.text, solo[s.spec])
    recorded = Counter(r.result.request_id for r in served.telemetry.recent())
    assert all(recorded[s.request_id] == 1 for s in streams), "the server recorded each request once"


def _check_pool_back(engine: Engine) -> None:
    scheduler = engine.scheduler
    assert (scheduler.running, scheduler.waiting, scheduler.held_bytes) == (0, 0, 0)
    assert engine.pool.request_bytes == 0  # every request's blocks are back in the pool
    assert engine.pool.held_bytes == engine.pool.prefix_only_bytes  # what it holds is the prefix cache's


def test_two_hundred_at_once_at_the_defaults_are_all_served(chatty_tiny_dir, capsys):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 * MIB)
    # By capacity: the CPU step's token budget (80, or 56 where the products multiply float32 rows), one each.
    assert engine.steps.limits.max_num_seqs == default_token_budget(engine.device)
    with serving(engine, GatewayConfig()) as served:  # no key, and every other setting the default
        assert engine.scheduler.max_queue == memory_queue_bound(engine) >= BURST
        solo = [asyncio.run(_send_all(served.url, f"solo{spec}", [spec]))[0] for spec in range(len(SPECS))]
        references = [s.text for s in solo]
        _check(solo, references, served)
        assert len(set(references)) == len(SPECS), references  # each its own: a swapped token would show

        burst = [i % len(SPECS) for i in range(BURST)]
        one_at_a_time = wait_until_idle(engine, ("solo",))  # the threads and connections of one client
        first = asyncio.run(_send_all(served.url, "first", burst))
        baseline = wait_until_idle(engine, ("solo", "first-"), one_at_a_time)  # its connections closed
        _check(first, references, served)
        _check_pool_back(engine)
        assert max(s.widest for s in first) > 8  # more than the old fixed 8 slots ran together

        second = asyncio.run(_send_all(served.url, "second", burst))
        after = wait_until_idle(engine, ("second-",), baseline)
        _check(second, references, served)
        _check_pool_back(engine)
        assert not workers(("solo", "first-", "second-")), "every request's worker thread has ended"
        grown = after.minus(baseline)
        with capsys.disabled():
            print(f"\nburst: {BURST} at once, twice; widest step {max(s.widest for s in first + second)} "
                  f"sequences; the second burst left {grown.line()}")  # fmt: skip
        assert after.within_slack_of(baseline), (baseline, after)
