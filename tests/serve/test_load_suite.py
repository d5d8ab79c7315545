"""The load suite: `reqscope serve` under many clients at once, on loopback, bounded in time.

200 requests at concurrency 12 over the chatty tiny model: prompts of mixed lengths (the long
ones longer than the step's token budget, so they prefill in chunks once the engine batches),
clients that leave mid-stream, clients that give up while their request waits in the queue, and
more clients than the queue holds (503 queue_full, this server's overflow). Afterwards:

- every 200 stream ends with its finish chunk (with the `reqscope` report), usage and [DONE];
- every stream equals the same request run alone before the load (greedy, or seeded sampling
  with the same seed; alone and without the prefix cache), and a stream cut short is a prefix
  of it: no token of one request ever shows in another's stream;
- the requests really shared steps (the batch reached MAX_NUM_SEQS) and long prompts really
  prefilled in chunks, by their own batch facts, which every report carries;
- the KV is all back (nothing reserved, nothing running or waiting, the prefix cache within the
  budget), and the process's threads, file descriptors and RSS are back within a stated slack.

A second test forces preemptions with a pool too small for the batch's decodes: every stream
still equals its solo run, and every block a request held is back in the pool afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import aiohttp
import psutil
from serve_harness import authorized, chat_body, one, scrape, serving

from minengine.engine.engine import Engine
from minengine.engine.events import RequestResult
from minengine.kv.arithmetic import MIB
from reqscope.serve.telemetry import batch_json

REQUESTS = 200
CONCURRENCY = 12
MAX_QUEUE = CONCURRENCY  # the steady load always fits; the bursts overflow it
BURST = 12  # requests a client sends at once, twice in the load: more than the queue has room for
BURSTS_AT = (60, 130)
REFUSED_PAUSE_S = 0.2  # a refused client's pause before its next request (the server says 1 s)
MAX_NUM_SEQS = 4  # serve admits this many at once; they decode together
MAX_NUM_BATCHED_TOKENS = 64  # the long prompts (about 300 tokens) prefill in several chunks
KV_BUDGET = 64 * MIB
# The chatty model's 16-token block is 8 KiB in float32; the longest request (about 330 tokens with
# its output) holds 21 blocks. 48 blocks hold any one request, never four long ones decoding at once.
PREEMPTING_KV_BUDGET = 48 * 8 * 1024

# What "flat" allows, after a warm-up that ran every prompt alone and then WARM_UP requests at the
# load's concurrency. Without that warm-up the first load grows RSS by about 150 MiB here, once
# (the C heap of each thread that ran a step); a second, third and fourth load by 29, 11 and 6.
WARM_UP = 48
THREAD_SLACK = 2
FD_SLACK = 8
RSS_SLACK = 96 * MIB

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
    "while", "seven", "wizards", "quietly", "judge", "boxing", "matches",
)  # fmt: skip


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True)
class Spec:
    """One distinct request the load repeats; its solo run is the reference for every repeat."""

    prompt: str
    max_tokens: int
    temperature: float
    seed: int

    def body(self, stream: bool) -> dict:
        """The chat body (ignore_eos: every run makes its max_tokens, so a stream is long enough to leave)."""
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        return chat_body(
            self.prompt,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            ignore_eos=True,
            **extra,
        )


def _specs() -> list[Spec]:
    rng = random.Random(20)
    lengths = [2, 3, 5, 8, 12, 20, 30, 45, 60, 90, 120, 160, 220, 250]  # words: a few to about 300 tokens
    specs = []
    for i, words in enumerate(lengths):
        sampled = i % 3 == 2  # a third sample (with their own seed), the rest are greedy
        specs.append(Spec(_prompt(rng, words), rng.randint(10, 24), 0.8 if sampled else 0.0, 1000 + i))
    return specs


@dataclass(frozen=True)
class Planned:
    """One request of the load: which spec, and what its client does."""

    request_id: str
    spec: int
    # "stream" (reads it all), "whole" (not streamed), "leave" (mid-stream), "give_up" (while queued),
    # "burst" (sent at once with the rest of its burst, not streamed)
    client: str
    leave_after: int = 0  # chunks of text a leaving client reads first


def _plan(specs: list[Spec]) -> list[Planned]:
    rng = random.Random(2020)
    clients = rng.choices(["stream", "whole", "leave", "give_up"], weights=[66, 8, 14, 12], k=REQUESTS)
    for start in BURSTS_AT:
        clients[start : start + BURST] = ["burst"] * BURST
    return [
        Planned(f"load-{i:03d}", rng.randrange(len(specs)), client, rng.randint(1, 4))
        for i, client in enumerate(clients)
    ]


@dataclass
class Outcome:
    """What the client saw."""

    status: int | None = None  # None: the client gave up before the response began
    texts: list[str] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)  # a stream's SSE data, in order
    body: dict | None = None  # a whole response, or a refusal's error


@dataclass(frozen=True)
class Resources:
    """The process's footprint: threads, open file descriptors, resident memory."""

    threads: int
    fds: int
    rss: int

    @classmethod
    def now(cls) -> Resources:
        """The footprint now, after a garbage collection."""
        gc.collect()
        process = psutil.Process()
        return cls(process.num_threads(), process.num_fds(), process.memory_info().rss)


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome, leave_after: int | None) -> None:
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        out.payloads.append(payload)
        if payload.startswith("{"):
            choices = json.loads(payload)["choices"]
            if choices and choices[0]["delta"].get("content"):
                out.texts.append(choices[0]["delta"]["content"])
                if leave_after is not None and len(out.texts) >= leave_after:
                    resp.close()  # gone mid-stream
                    return


async def _send(session: aiohttp.ClientSession, url: str, plan: Planned, spec: Spec) -> Outcome:
    out = Outcome()
    stream = plan.client not in ("whole", "burst")
    headers = authorized({"x-request-id": plan.request_id})
    post = session.post(url, json=spec.body(stream), headers=headers)
    if plan.client == "give_up":
        try:  # the status comes only once the request is admitted: until then it waits in the queue
            resp = await asyncio.wait_for(post, timeout=0.02)
        except TimeoutError:
            return out
        out.status = resp.status
        if resp.status != 200:
            out.body = await resp.json()
        resp.close()  # answered before the client's patience ran out: it leaves at once
        return out
    async with post as resp:
        out.status = resp.status
        if resp.status != 200:
            out.body = await resp.json()
        elif stream:
            await _read_stream(resp, out, plan.leave_after if plan.client == "leave" else None)
        else:
            out.body = await resp.json()
    return out


async def _drive(url: str, specs: list[Spec], plans: list[Planned], concurrency: int) -> dict[str, Outcome]:
    todo = deque(plans)  # taken from by the clients in turn (one event loop: no lock needed)
    outcomes: dict[str, Outcome] = {}

    async def send(plan: Planned) -> None:
        outcomes[plan.request_id] = await _send(session, url, plan, specs[plan.spec])

    async def client() -> None:
        while todo:
            batch = [todo.popleft()]
            while batch[0].client == "burst" and todo and todo[0].client == "burst":
                batch.append(todo.popleft())
            await asyncio.gather(*(send(plan) for plan in batch))
            if any(outcomes[plan.request_id].status == 503 for plan in batch):
                await asyncio.sleep(REFUSED_PAUSE_S)  # as a client honouring Retry-After would, only shorter

    connector = aiohttp.TCPConnector(limit=0)  # the clients, not the connector, bound the concurrency
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return outcomes


def _solo_texts(url: str, specs: list[Spec]) -> list[str]:
    """Each spec run alone, one after another: the reference streams."""
    plans = [Planned(f"solo-{i:02d}", i, "stream") for i in range(len(specs))]
    outcomes = asyncio.run(_drive(url, specs, plans, concurrency=1))
    texts = []
    for plan in plans:
        out = outcomes[plan.request_id]
        assert out.status == 200 and out.payloads[-1] == "[DONE]", (plan, out)
        texts.append("".join(out.texts))
    assert len(set(texts)) == len(texts), "every spec streams its own text, so a swapped token would show"
    return texts


def _warm_up(url: str, specs: list[Spec], solo: list[str]) -> None:
    """Every spec a few times at the load's concurrency, so that what the process keeps once it
    has run many requests at once (the worker threads' malloc arenas) is in the baseline."""
    plans = [Planned(f"warm-{i:02d}", i % len(specs), "stream") for i in range(WARM_UP)]
    outcomes = asyncio.run(_drive(url, specs, plans, CONCURRENCY))
    for plan in plans:
        out = outcomes[plan.request_id]
        assert out.status == 200 and "".join(out.texts) == solo[plan.spec], plan


def _check_closing(payloads: list[str], spec: Spec, result: RequestResult) -> None:
    """A finished stream: ..., the finish chunk with the report (its batch facts the request's
    own), the usage chunk, [DONE]."""
    assert payloads[-1] == "[DONE]"
    finish, usage = json.loads(payloads[-3]), json.loads(payloads[-2])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["reqscope"]["batch"] == batch_json(result.batch)
    # Prefill, then each decode; a preemption's recompute ends in the chunk that gives its next token.
    assert result.batch.steps >= result.batch.prefill_chunks + spec.max_tokens - 1 - result.batch.preemptions
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == spec.max_tokens


def _wait_until_idle(served, baseline: Resources, timeout_s: float = 15.0) -> Resources:
    """Wait for every worker thread to end and every connection to close; the footprint then."""
    deadline = time.monotonic() + timeout_s
    while True:
        scheduler = served.engine.scheduler
        now = Resources.now()
        idle = scheduler.running == 0 and scheduler.waiting == 0 and now.threads <= baseline.threads + THREAD_SLACK
        if (idle and now.fds <= baseline.fds + FD_SLACK) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@dataclass(frozen=True)
class LoadCounts:
    """What one run of the load saw."""

    ok: int  # 200s read to the end (streamed or whole)
    left_mid_stream: int  # 200 streams whose client left after a few chunks
    cancelled_in_queue: int  # clients that gave up while their request waited for admission
    gave_up_later: int  # clients that gave up, but whose request had been admitted (or had not reached the queue)
    queue_full: int  # 503s: the queue already held MAX_QUEUE
    preemptions: int  # /metrics' num_preemptions_total
    mean_batch: float  # sequences per step, over the ok requests' steps (their batch facts)
    max_batch: int
    chunked: int  # ok requests whose prompt prefilled in more than one chunk
    growth: Resources  # after the load less before it

    def line(self) -> str:
        """The counts as the suite reports them."""
        return (
            f"load: {REQUESTS} requests at concurrency {CONCURRENCY}: {self.ok} ok, "
            f"{self.left_mid_stream} left mid-stream, {self.cancelled_in_queue} cancelled in the queue "
            f"({self.gave_up_later} gave up outside it), {self.queue_full} refused with 503 queue_full, "
            f"{self.preemptions} preemptions; batch mean {self.mean_batch:.2f}, max {self.max_batch}; "
            f"{self.chunked} prompts prefilled in chunks; afterwards threads {self.growth.threads:+d}, "
            f"fds {self.growth.fds:+d}, RSS {self.growth.rss / MIB:+.0f} MiB"
        )


def run_load(served, specs: list[Spec]) -> LoadCounts:
    """Drive the load at `served` and check every response against its solo run; the counts."""
    url = served.v1 + "/chat/completions"
    # Alone and without the prefix cache: every reference prefills its whole prompt itself. The
    # load starts with an empty cache, so each prompt's first run in it prefills in chunks too.
    cache_on = served.engine.prefix_cache is not None
    served.engine.use_prefix_cache(False)
    solo = _solo_texts(url, specs)
    _warm_up(url, specs, solo)
    served.engine.use_prefix_cache(cache_on)
    baseline = Resources.now()
    plans = _plan(specs)
    outcomes = asyncio.run(_drive(url, specs, plans, CONCURRENCY))
    after = _wait_until_idle(served, baseline)
    records = {s.result.request_id: s for s in served.telemetry.recent()}

    tally: Counter[str] = Counter()
    ok_ids: set[str] = set()
    for plan in plans:
        out, spec, reference = outcomes[plan.request_id], specs[plan.spec], solo[plan.spec]
        if out.status == 503:
            assert out.body["error"]["code"] == "queue_full", out.body
            tally["queue_full"] += 1
        elif plan.client == "give_up":
            record = records.get(plan.request_id)
            queued = (
                record is not None
                and record.result.finish_reason == "cancelled"
                and "prefill" not in {s.name for s in record.result.stages}
            )
            tally["cancelled_in_queue" if queued else "gave_up_later"] += 1
        elif plan.client in ("whole", "burst"):
            assert out.status == 200, out
            assert out.body["choices"][0]["message"]["content"] == reference, plan
            assert out.body["usage"]["completion_tokens"] == spec.max_tokens
            assert out.body["reqscope"]["batch"] == batch_json(records[plan.request_id].result.batch)
            ok_ids.add(plan.request_id)
            tally["ok"] += 1
        elif plan.client == "leave" and len(out.texts) >= plan.leave_after and out.payloads[-1] != "[DONE]":
            assert reference.startswith("".join(out.texts)), plan  # what it saw was its own stream
            record = records[plan.request_id]
            if record.result.finish_reason == "cancelled":  # else it ended before the server noticed
                assert record.tokens_after_disconnect <= 1, plan  # only the step already running
            tally["left_mid_stream"] += 1
        else:  # read to the end (a leaving client whose stream ended first included)
            assert out.status == 200, (plan, out)
            assert "".join(out.texts) == reference, plan
            _check_closing(out.payloads, spec, records[plan.request_id].result)
            ok_ids.add(plan.request_id)
            tally["ok"] += 1

    batches = [records[p.request_id].result.batch for p in plans if p.request_id in ok_ids]
    steps = sum(b.steps for b in batches)
    counts = LoadCounts(
        tally["ok"],
        tally["left_mid_stream"],
        tally["cancelled_in_queue"],
        tally["gave_up_later"],
        tally["queue_full"],
        int(one(scrape(served), "reqscope:num_preemptions_total")),
        sum(b.mean_batch * b.steps for b in batches) / steps,
        max(b.max_batch for b in batches),
        sum(1 for b in batches if b.prefill_chunks > 1),
        Resources(after.threads - baseline.threads, after.fds - baseline.fds, after.rss - baseline.rss),
    )
    print(counts.line())
    assert sum(tally.values()) == REQUESTS, counts.line()

    scheduler = served.engine.scheduler
    assert (scheduler.running, scheduler.waiting, scheduler.held_bytes) == (0, 0, 0), "every reservation is back"
    cache = served.engine.prefix_cache
    if cache is not None:
        assert cache.kept_bytes <= scheduler.kv_budget_bytes
    assert after.threads <= baseline.threads + THREAD_SLACK, (baseline, after)
    assert after.fds <= baseline.fds + FD_SLACK, (baseline, after)
    assert after.rss <= baseline.rss + RSS_SLACK, (baseline, after)
    return counts


def test_two_hundred_requests_at_concurrency_twelve(chatty_tiny_dir, capsys):
    engine = Engine(
        chatty_tiny_dir,
        device="cpu",
        dtype="float32",
        kv_budget_bytes=KV_BUDGET,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    with serving(engine, max_queue=MAX_QUEUE) as served:
        counts = run_load(served, _specs())
    with capsys.disabled():
        print("\n" + counts.line())
    assert counts.ok >= REQUESTS // 2, counts.line()
    assert counts.left_mid_stream > 0 and counts.cancelled_in_queue > 0 and counts.queue_full > 0, counts.line()
    assert counts.max_batch == MAX_NUM_SEQS and counts.mean_batch > 1.5, counts.line()  # they decoded together
    assert counts.chunked > 0, counts.line()


def test_a_pool_too_small_for_the_batch_preempts_and_every_stream_still_matches(chatty_tiny_dir, capsys):
    specs = _specs()
    engine = Engine(
        chatty_tiny_dir,
        device="cpu",
        dtype="float32",
        kv_budget_bytes=PREEMPTING_KV_BUDGET,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    with serving(engine, max_queue=MAX_QUEUE) as served:
        counts = run_load(served, specs)
    with capsys.disabled():
        print("\n" + counts.line())
    assert counts.preemptions > 0, counts.line()
    assert engine.pool.request_bytes == 0  # every request's blocks are back (the prefix cache may keep its own)
    assert engine.pool.held_bytes == engine.pool.prefix_only_bytes
