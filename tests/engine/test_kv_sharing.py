"""A request's KV blocks by who else holds them (`KVUsage.sharing`), against the pool's own
reference counts: alone, after a prefix cache hit, and beside another request sharing its prefix.

The expected counts never come from the request's block table: they are read off the pool, per
block (holders, and whether the prefix cache is one), and per holder (`held_by`).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from minengine.config import ModelConfig
from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PrefillEvent, PrefixCacheEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.kv.block_pool import PREFIX, BlockFormat, BlockPool
from minengine.kv.cache import KVCache
from minengine.kv.usage import BlockSharing
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
# Long enough for several full blocks of 16 before the question.
SYSTEM = "You help people travel with a wheelchair: entrances, lifts, rooms, bathrooms, transport. " * 3


def request(request_id: str, max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest.from_prompt("Which hotels in Kyoto have roll-in showers?", system=SYSTEM,
                                         sampling=GREEDY, max_tokens=max_tokens, request_id=request_id)  # fmt: skip


@pytest.fixture
def engine(chatty_tiny_dir):
    """A fresh engine over the chatty tiny model: its pool and prefix cache start empty."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20)


def block_format(engine: Engine) -> BlockFormat:
    c = engine.cfg
    return BlockFormat(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, torch.float32)


def holders_per_block(pool: BlockPool, fmt: BlockFormat) -> dict[tuple[int, bool], int]:
    """Held blocks counted by (holders, whether the prefix cache is one of them)."""
    store = pool.store(fmt)
    counts: dict[tuple[int, bool], int] = {}
    for b, refs in enumerate(store.refs):
        if refs:
            key = (refs, bool(store.prefix[b]))
            counts[key] = counts.get(key, 0) + 1
    return counts


def check_token(engine: Engine, event: TokenEvent, owner: str, expected: BlockSharing) -> None:
    """`event`'s split is `expected`, and adds up to the blocks the pool says `owner` holds."""
    sharing = event.kv.sharing
    assert sharing == expected, (event.index, sharing, expected)
    assert sharing.own + sharing.with_requests + sharing.with_prefix == sharing.blocks == event.kv.blocks
    assert sharing.blocks == engine.pool.held_by(owner)
    assert event.kv.physical_bytes == sharing.blocks * sharing.block_bytes  # the blocks really held
    assert sharing.own_bytes + sharing.with_requests_bytes + sharing.with_prefix_bytes == event.kv.physical_bytes


def run(engine: Engine, req: GenerationRequest) -> list:
    events = list(engine.start(req))
    assert isinstance(events[-1], DoneEvent) and events[-1].result.error is None
    return events


def test_a_request_alone_holds_every_block_as_its_own(engine):
    fmt = block_format(engine)
    session = engine.start(request("alone"))
    tokens = 0
    for event in session:
        if isinstance(event, PrefillEvent):
            assert event.kv.sharing == BlockSharing(event.kv.blocks, 0, 0, fmt.nbytes)
        if isinstance(event, TokenEvent):
            assert holders_per_block(engine.pool, fmt) == {(1, False): engine.pool.held_by("alone")}
            check_token(engine, event, "alone", BlockSharing(engine.pool.held_by("alone"), 0, 0, fmt.nbytes))
            tokens += 1
    assert tokens == 6


def test_a_prefix_cache_hit_shares_its_blocks_with_the_prefix_cache(engine):
    fmt = block_format(engine)
    run(engine, request("first"))
    session = engine.start(request("second"))
    hit = 0
    tokens = 0
    for event in session:
        if isinstance(event, PrefixCacheEvent):
            hit = event.blocks_hit
        if isinstance(event, TokenEvent):
            counts = holders_per_block(engine.pool, fmt)
            assert counts[(2, True)] == hit  # held by the prefix cache and this request
            held = engine.pool.held_by("second")
            assert counts.get((1, False), 0) == held - hit  # no other request runs: the rest is its own
            check_token(engine, event, "second", BlockSharing(held - hit, 0, hit, fmt.nbytes))
            tokens += 1
    assert hit >= 3 and tokens == 6


def test_two_requests_sharing_a_prefix_count_it_as_shared_with_requests(engine):
    fmt = block_format(engine)
    run(engine, request("warm"))  # the prefix cache keeps the prompt's blocks
    session = engine.start(request("held", max_tokens=4))
    held = iter(session)
    hit = 0
    for event in held:  # up to its first token; then held there, out of the batch, keeping its blocks
        if isinstance(event, PrefixCacheEvent):
            hit = event.blocks_hit
        if isinstance(event, TokenEvent):
            check_token(engine, event, "held", BlockSharing(engine.pool.held_by("held") - hit, 0, hit, fmt.nbytes))
            session.hold()
            break
    assert hit >= 3

    tokens = 0
    for event in engine.start(request("beside")):
        if isinstance(event, TokenEvent):
            counts = holders_per_block(engine.pool, fmt)
            assert counts[(3, True)] == hit  # the prefix cache's, held by both requests
            own = engine.pool.held_by("beside") - hit
            check_token(engine, event, "beside", BlockSharing(own, hit, 0, fmt.nbytes))
            tokens += 1
    assert tokens == 6

    later = [e for e in held if isinstance(e, TokenEvent)]  # "beside" has let go: the prefix cache's again
    assert len(later) == 3
    for event in later:
        assert event.kv.sharing.with_requests == 0 and event.kv.sharing.with_prefix == hit
        assert event.kv.sharing.blocks == event.kv.blocks
    assert engine.pool.request_bytes == 0  # every request's blocks back (the prefix cache keeps its own)


def test_a_request_waiting_for_admission_holds_none_of_its_hit(chatty_tiny_dir):
    """Queued requests used to hold their prefix hits' blocks while they waited: a dozen of them
    once pinned most of a small pool, and nothing could run. The hit is taken once admitted."""
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20, max_num_seqs=1)
    fmt = block_format(engine)
    run(engine, request("warm"))
    session = engine.start(request("running", max_tokens=3))
    running = iter(session)
    next(e for e in running if isinstance(e, TokenEvent))
    session.hold()  # holding the only running slot
    kept = holders_per_block(engine.pool, fmt)

    waited: list = []
    waiting = threading.Thread(target=lambda: waited.extend(engine.start(request("waiting"))), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 30
    while engine.scheduler.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.scheduler.waiting == 1
    time.sleep(0.1)  # it asks whether it fits, again and again, while it waits
    assert holders_per_block(engine.pool, fmt) == kept
    assert set(engine.pool.holders()) == {PREFIX, "running"}

    list(running)
    waiting.join(timeout=60)
    assert isinstance(waited[-1], DoneEvent) and waited[-1].result.error is None
    hits = [e.blocks_hit for e in waited if isinstance(e, PrefixCacheEvent)]
    assert hits and hits[0] >= 3  # admitted, it still shares what the prefix cache kept
    assert engine.pool.request_bytes == 0


def test_a_cache_outside_the_pool_has_no_split(chatty_tiny_dir):
    cfg = ModelConfig.from_file(chatty_tiny_dir)
    cache = KVCache(cfg, 32, device=torch.device("cpu"), compute_dtype=torch.float32)
    assert cache.usage().sharing is None
