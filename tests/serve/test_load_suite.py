"""The load suite: `reqscope serve` under many clients at once, on loopback, bounded in time.

200 requests from 32 concurrent clients over the chatty tiny model, at serve's own admission:
no cap on running requests is set (the engine's default, by capacity: as many as the KV pool
holds and the step's token budget gives a token each, 64 on a CPU) and the queue is bounded by
memory (`memory_queue_bound`), with no rate limit. The load mixes prompts of several lengths
(the long ones longer than the CPU step's 64-token budget, so they prefill in chunks beside the
decodes), clients that read a whole stream, clients that take the answer whole, clients that
leave mid-stream, clients that give up while their request is not yet answered, and twice a
client that sends 12 requests at once (43 in flight). Afterwards, for each run:

- nothing lost: every request is accounted for, none refused, every finished stream ends with
  its finish chunk (with the `reqscope` report), usage and [DONE], and the server recorded each
  request once;
- nothing mixed between requests: every stream equals the same request run alone before the
  load (greedy, or seeded sampling with the same seed; alone and without the prefix cache), a
  stream cut short is a prefix of it, and each report's batch facts are its own request's;
- every block back in the pool: nothing reserved, running or waiting, no request holds a block
  (`pool.request_bytes == 0`) and what the pool still holds is the prefix cache's alone;
- the process's threads, file descriptors and RSS flat: back within a stated slack of what they
  were after a warm-up at the same concurrency.

The first run has the KV room for every request in flight: they all run at once (far more
than the old fixed 8), none waits for a slot. The second forces preemptions: a pool too small
for the batch's decodes, so admission is bounded by the pool, requests wait in the queue (and
some clients give up there), and running ones are preempted and recomputed; every stream,
preempted ones included, still equals its solo run.

No queue overflow here: at the defaults nothing is refused. A full queue's 503 (an explicit
--max-queue) is tested in test_serve_admission.py and, under concurrent streams, in
test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp
from footprint import Resources, wait_until_idle, workers
from serve_harness import authorized, chat_body, one, scrape, serving

from minengine.engine.engine import Engine
from minengine.engine.events import RequestResult
from minengine.kv.arithmetic import MIB
from reqscope.serve.app import memory_queue_bound
from reqscope.serve.telemetry import batch_json

REQUESTS = 200
CONCURRENCY = 32
BURST = 12  # requests one client sends at once, twice in the load
BURSTS_AT = (60, 130)
IN_FLIGHT = CONCURRENCY - 1 + BURST  # the most requests the load ever has in flight
GIVE_UP_S = 0.02  # a giving-up client's patience for the response to begin
KV_BUDGET = 64 * MIB  # room for every request in flight
# The chatty model's 16-token block is 8 KiB in float32; the load's requests hold 3 to 20 blocks
# each (about 7 on average), the longest about 330 tokens with its output. 48 blocks hold any one
# request, and half a dozen of the load's at once: never the 32 the clients keep sending, so
# requests wait for room in the queue as well as being preempted (twice as many blocks still
# preempt, but the queue is then too short-lived for the giving-up clients to be caught in it).
BLOCK_BYTES = 8 * 1024
PREEMPTING_KV_BUDGET = 48 * BLOCK_BYTES

# The footprint's baseline is taken after a warm-up that ran every prompt alone and then WARM_UP
# requests at the load's concurrency, once every request's worker thread is gone; "flat" is within
# `footprint`'s slack of it (threads +2, fds +8, RSS +64 MiB, the C heap trimmed).
WARM_UP = 2 * CONCURRENCY
REQUEST_PREFIXES = ("solo-", "warm-", "load-")  # the IDs this suite gives its requests

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
    # "stream" (reads it all), "whole" (not streamed), "leave" (mid-stream), "give_up" (before the
    # response begins), "burst" (sent at once with the rest of its burst, not streamed)
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


@dataclass
class Peaks:
    """The most requests the scheduler had running, and waiting, at once (sampled)."""

    running: int = 0
    waiting: int = 0


@contextmanager
def watching(engine: Engine) -> Iterator[Peaks]:
    """Sample the engine's scheduler every few milliseconds within the block."""
    peaks, stop = Peaks(), threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            scheduler = engine.scheduler
            peaks.running = max(peaks.running, scheduler.running)
            peaks.waiting = max(peaks.waiting, scheduler.waiting)

    thread = threading.Thread(target=sample, name="load-suite-sampler", daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        thread.join()


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
            resp = await asyncio.wait_for(post, timeout=GIVE_UP_S)
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

    connector = aiohttp.TCPConnector(limit=0)  # the clients, not the connector, bound the concurrency
    timeout = aiohttp.ClientTimeout(total=600)  # a loaded 2-core machine is slow, never stuck
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
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
    """Every spec a few times at the load's concurrency (each stream checked against its solo
    run, the prefix cache on), so that what the process keeps once it has run many requests at
    once (the KV pool's storage, the C heap's arenas) is in the baseline."""
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


@dataclass(frozen=True)
class LoadCounts:
    """What one run of the load saw."""

    ok: int  # 200s read to the end (streamed or whole)
    left_mid_stream: int  # 200 streams whose client left after a few chunks
    cancelled_in_queue: int  # clients that gave up while their request waited for admission
    gave_up_later: int  # clients that gave up, but whose request had been admitted (or had not reached the queue)
    preemptions: int  # /metrics' num_preemptions_total
    preempted_ok: int  # ok requests preempted at least once (and still equal to their solo run)
    peaks: Peaks  # the most running and waiting at once
    mean_batch: float  # sequences per step, over the ok requests' steps (their batch facts)
    max_batch: int
    chunked: int  # ok requests whose prompt prefilled in more than one chunk
    growth: Resources  # after the load less before it

    def line(self) -> str:
        """The counts as the suite reports them."""
        return (
            f"load: {REQUESTS} requests at concurrency {CONCURRENCY}: {self.ok} ok, "
            f"{self.left_mid_stream} left mid-stream, {self.cancelled_in_queue} cancelled in the queue "
            f"({self.gave_up_later} gave up outside it), {self.preemptions} preemptions "
            f"({self.preempted_ok} of the ok requests preempted); at most {self.peaks.running} running and "
            f"{self.peaks.waiting} waiting; batch mean {self.mean_batch:.2f}, max {self.max_batch}; "
            f"{self.chunked} prompts prefilled in chunks; afterwards {self.growth.line()}"
        )


def run_load(served, specs: list[Spec]) -> LoadCounts:
    """Drive the load at `served` and check every response against its solo run; the counts."""
    url = served.v1 + "/chat/completions"
    engine = served.engine
    assert engine.steps.limits.max_num_seqs >= IN_FLIGHT  # admission by capacity, not by a few slots
    assert engine.scheduler.max_queue == memory_queue_bound(engine)  # serve's default queue
    # Alone and without the prefix cache: every reference prefills its whole prompt itself. The
    # load starts with an empty cache, so each prompt's first run in it prefills in chunks too.
    cache_on = engine.prefix_cache is not None
    engine.use_prefix_cache(False)
    solo = _solo_texts(url, specs)
    one_at_a_time = wait_until_idle(engine, REQUEST_PREFIXES)  # the threads and connections of one client
    engine.use_prefix_cache(cache_on)
    _warm_up(url, specs, solo)  # with the prefix cache, so the pool's storage has grown as under load
    engine.use_prefix_cache(False)  # emptied: the load's first run of each prompt prefills it all
    engine.use_prefix_cache(cache_on)
    baseline = wait_until_idle(engine, REQUEST_PREFIXES, one_at_a_time)  # the warm-up's connections closed
    assert not workers(REQUEST_PREFIXES), workers(REQUEST_PREFIXES)
    plans = _plan(specs)
    with watching(engine) as peaks:
        outcomes = asyncio.run(_drive(url, specs, plans, CONCURRENCY))
    after = wait_until_idle(engine, REQUEST_PREFIXES, baseline)
    records = {s.result.request_id: s for s in served.telemetry.recent()}
    recorded = Counter(s.result.request_id for s in served.telemetry.recent())
    assert all(n == 1 for n in recorded.values()), [i for i, n in recorded.items() if n > 1]

    tally: Counter[str] = Counter()
    ok_ids: set[str] = set()
    for plan in plans:
        out, spec, reference = outcomes[plan.request_id], specs[plan.spec], solo[plan.spec]
        assert out.status in (None, 200), (plan, out)  # nothing refused: the defaults queue what waits
        if plan.client == "give_up":
            record = records.get(plan.request_id)
            queued = (  # cancelled before the scheduler admitted it
                record is not None
                and record.result.finish_reason == "cancelled"
                and "scheduler_admit" not in {e.name for e in record.result.timeline}
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
        int(one(scrape(served), "reqscope:num_preemptions_total")),
        sum(1 for b in batches if b.preemptions),
        peaks,
        sum(b.mean_batch * b.steps for b in batches) / steps,
        max(b.max_batch for b in batches),
        sum(1 for b in batches if b.prefill_chunks > 1),
        after.minus(baseline),
    )
    print(counts.line())
    assert sum(tally.values()) == REQUESTS, counts.line()
    # Every request that was not a give-up reached the server and was recorded there, once.
    assert all(p.request_id in records for p in plans if p.client != "give_up"), counts.line()

    scheduler = engine.scheduler
    assert not workers(REQUEST_PREFIXES), workers(REQUEST_PREFIXES)  # every request's worker thread has ended
    assert (scheduler.running, scheduler.waiting, scheduler.held_bytes) == (0, 0, 0), "every reservation is back"
    assert engine.pool.request_bytes == 0, "every request's blocks are back in the pool"
    assert engine.pool.held_bytes == engine.pool.prefix_only_bytes, "what the pool holds is the prefix cache's"
    cache = engine.prefix_cache
    if cache is not None:
        assert cache.kept_bytes <= scheduler.kv_budget_bytes
    assert after.within_slack_of(baseline), (baseline, after, counts.line())
    return counts


def test_two_hundred_requests_at_concurrency_32_all_run_at_once(chatty_tiny_dir, capsys):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=KV_BUDGET)
    with serving(engine) as served:  # serve's defaults: admission by capacity, a queue bounded by memory
        counts = run_load(served, _specs())
    with capsys.disabled():
        print("\n" + counts.line())
    assert counts.ok >= REQUESTS // 2, counts.line()
    assert counts.left_mid_stream > 0, counts.line()
    # The pool holds them all: no request waits for a slot (so no giving-up client is caught in the
    # queue: a request is cancelled there only from its wait), none is preempted. (The sampled peak
    # of waiting requests may still catch one between entering the queue and leaving it at once.)
    assert counts.peaks.running > 16 and counts.max_batch > 16, counts.line()  # the old default ran 8
    assert counts.cancelled_in_queue == 0, counts.line()
    assert counts.preemptions == 0, counts.line()
    assert counts.chunked > 0, counts.line()


def test_a_pool_too_small_for_the_batch_at_concurrency_32_preempts_and_every_stream_still_matches(
    chatty_tiny_dir, capsys
):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=PREEMPTING_KV_BUDGET)
    with serving(engine) as served:
        counts = run_load(served, _specs())
    with capsys.disabled():
        print("\n" + counts.line())
    assert counts.ok >= REQUESTS // 2, counts.line()
    assert counts.preemptions > 0 and counts.preempted_ok > 0, counts.line()
    # Admission is bounded by the pool: requests wait for room, and some clients give up there.
    assert counts.peaks.waiting > 0 and counts.cancelled_in_queue > 0, counts.line()
    assert counts.left_mid_stream > 0 and counts.chunked > 0, counts.line()
