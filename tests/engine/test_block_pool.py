"""The block pool: blocks of one byte budget by format, reference counts, who holds what, claims
that keep a request's blocks consecutive, storage grown in segments, and exhaustion."""

from __future__ import annotations

import pytest
import torch

from minengine.kv import block_pool
from minengine.kv.arithmetic import kv_bytes_per_token
from minengine.kv.block_pool import PREFIX, BlockFormat, BlockPool, PoolExhausted
from reqscope.wording import worded

CPU = torch.device("cpu")
# 1 layer x 1 head x 8 dims x 16 positions x (K and V) x 4 bytes = 1 KiB a block
SMALL = BlockFormat(layers=1, heads=1, head_dim=8, block_size=16, dtype=torch.float32)
KIB = 1024


def pool_of(blocks: int, **kwargs) -> BlockPool:
    return BlockPool(blocks * SMALL.nbytes, CPU, **kwargs)


def test_a_block_holds_every_layers_k_and_v_by_the_seeds_formula():
    assert SMALL.nbytes == SMALL.payload_bytes == kv_bytes_per_token(1, 1, 8, 4) * 16 == KIB
    fp8 = BlockFormat(3, 2, 8, 16, torch.float8_e4m3fn)
    assert fp8.payload_bytes == kv_bytes_per_token(3, 2, 8, 1) * 16
    assert fp8.nbytes == fp8.payload_bytes + 2 * 3 * 2 * 16 * 4  # a float32 scale per position, head, K and V


def test_nothing_is_allocated_before_a_block_is_wanted_and_segments_double():
    pool = BlockPool(1 << 30, CPU, first_segment_bytes=4 * KIB)
    pool.store(SMALL)
    assert pool.committed_bytes == 0
    first = pool.allocate(SMALL, "a", 1)
    assert pool.committed_bytes == 4 * KIB  # the first segment
    pool.allocate(SMALL, "b", 4)  # no run of 4 left in it: a second segment, twice the first
    assert pool.committed_bytes == 12 * KIB
    pool.free(SMALL, first, "a")
    small = BlockPool(8 * KIB, CPU, first_segment_bytes=64 * KIB)
    small.allocate(SMALL, "a", 1)
    assert small.committed_bytes == 2 * KIB  # a quarter of the budget at most
    small.allocate(SMALL, "a", 6)  # more than a quarter at once: the segment takes what the need takes
    small.allocate(SMALL, "a", 1)
    assert small.committed_bytes == 8 * KIB and small.held_bytes == 8 * KIB  # never past the budget
    with pytest.raises(PoolExhausted):
        small.allocate(SMALL, "a", 1)


def test_allocate_and_free_count_every_block_and_give_them_all_back():
    pool = pool_of(8)
    a = pool.allocate(SMALL, "a", 3)
    b = pool.allocate(SMALL, "b", 2)
    assert len(set(a + b)) == 5
    assert pool.held_by("a") == 3 and pool.held_bytes_by("b") == 2 * KIB
    assert pool.held_bytes == 5 * KIB and pool.free_bytes == 3 * KIB
    assert pool.holders() == {"a": 3, "b": 2}
    assert pool.free(SMALL, a, "a") == 3 and pool.free(SMALL, b, "b") == 2
    assert pool.held_bytes == 0 and pool.holders() == {} and pool.free_bytes == pool.budget_bytes
    assert pool.store(SMALL).free_blocks == pool.store(SMALL).capacity_blocks
    with pytest.raises(ValueError, match="holds no reference"):
        pool.free(SMALL, a[:1], "a")


def test_a_shared_block_is_freed_by_its_last_holder_only():
    pool = pool_of(8)
    blocks = pool.allocate(SMALL, "a", 2)
    pool.share(SMALL, blocks, "b")
    pool.share(SMALL, blocks[:1], PREFIX)
    assert [pool.refs(SMALL, b) for b in blocks] == [3, 2] and pool.shared_blocks == 2
    assert pool.held_bytes == 2 * KIB  # a shared block takes its bytes once
    assert pool.free(SMALL, blocks, "a") == 0
    assert pool.free(SMALL, blocks, "b") == 1  # the second block had no other holder left
    assert pool.prefix_only_bytes == KIB and pool.shared_blocks == 0
    assert pool.free(SMALL, blocks[:1], PREFIX) == 1 and pool.held_bytes == 0
    with pytest.raises(ValueError, match="only a held block"):
        pool.share(SMALL, blocks, "c")


def test_holdings_split_the_budget_into_own_others_prefix_and_free():
    pool = pool_of(16)
    a = pool.allocate(SMALL, "a", 4)
    b = pool.allocate(SMALL, "b", 3)
    kept = pool.allocate(SMALL, "c", 2)
    pool.share(SMALL, kept, PREFIX)
    pool.free(SMALL, kept, "c")  # now the prefix cache's alone
    pool.share(SMALL, a[:2], PREFIX)  # kept, and still a's
    pool.share(SMALL, a[:1], "b")  # a prefix hit of b's on a's first block
    seen = pool.holdings("a")
    assert (seen.own, seen.others, seen.prefix) == (4 * KIB, 3 * KIB, 2 * KIB)
    assert seen.own + seen.others + seen.prefix + seen.free == seen.budget == 16 * KIB
    seen = pool.holdings("b")
    assert (seen.own, seen.others, seen.prefix, seen.free) == (4 * KIB, 3 * KIB, 2 * KIB, 7 * KIB)
    for blocks, owner in ((a, "a"), (b, "b"), (a[:1], "b"), (a[:2], PREFIX), (kept, PREFIX)):
        pool.free(SMALL, blocks, owner)
    assert pool.held_bytes == 0 and pool.prefix_only_bytes == 0


def test_a_requests_blocks_stay_consecutive_while_others_allocate():
    pool = pool_of(64)  # a first segment of 16 blocks
    a = pool.allocate(SMALL, "a", 2, expect=8)  # room for 8 claimed next to its first 2
    b = pool.allocate(SMALL, "b", 2, expect=8)
    for _ in range(6):
        a += pool.allocate(SMALL, "a", 1, after=a[-1])
        b += pool.allocate(SMALL, "b", 1, after=b[-1])
    assert a == list(range(a[0], a[0] + 8)) and b == list(range(b[0], b[0] + 8))
    # Past its claim the next block is b's: a goes on in a run of its own, never in b's blocks.
    assert b[0] == a[-1] + 1
    a += pool.allocate(SMALL, "a", 1, after=a[-1])
    assert a[-1] not in b and pool.held_by("a") == 9


def test_claimed_blocks_go_to_others_only_when_nothing_else_is_free():
    pool = pool_of(8)
    a = pool.allocate(SMALL, "a", 1, expect=6)  # claims 5 more
    others = pool.allocate(SMALL, "b", 2)
    assert not set(others) & set(range(a[0], a[0] + 6))
    more = pool.allocate(SMALL, "b", 3)  # only claimed blocks are left
    assert len(more) == 3 and pool.held_bytes == 6 * KIB
    pool.unclaim(SMALL, "a")
    assert pool.store(SMALL).claims == {}


def test_exhaustion_evicts_the_prefix_cache_first_then_raises():
    pool = pool_of(4)
    kept = pool.allocate(SMALL, "done", 2)
    pool.share(SMALL, kept, PREFIX)
    pool.free(SMALL, kept, "done")
    evicted: list[int] = []

    def evictor(nbytes: int) -> int:
        if not kept:
            return 0
        block = kept.pop()
        evicted.append(block)
        pool.free(SMALL, [block], PREFIX)
        return SMALL.nbytes

    pool.evictor = evictor
    assert pool.can_allocate(SMALL, 4) and not pool.can_allocate(SMALL, 5)
    assert len(pool.allocate(SMALL, "a", 3)) == 3 and len(evicted) == 1
    pool.allocate(SMALL, "a", 1)
    assert len(evicted) == 2
    with pytest.raises(PoolExhausted) as caught:
        pool.allocate(SMALL, "b", 1)
    assert caught.value.owner == "b" and caught.value.wanted == 1
    assert worded(caught.value.message).endswith("raise --kv-budget-mib")


@pytest.mark.parametrize("floor_blocks", (0, 4))
def test_a_new_run_takes_written_blocks_the_prefix_cache_gives_up_before_fresh_pages(monkeypatch, floor_blocks):
    monkeypatch.setattr(block_pool, "KEPT_BEFORE_FRESH_PAGES", floor_blocks * SMALL.nbytes)
    pool = pool_of(64)  # a first segment of 16 blocks, most of them never written
    done = pool.allocate(SMALL, "done", 4, expect=4)
    pool.share(SMALL, done, PREFIX)
    pool.free(SMALL, done, "done")  # a finished request's blocks, kept by the prefix cache alone
    kept = list(done)

    def evictor(nbytes: int) -> int:  # least recently used first, as the prefix cache evicts
        freed = 0
        while kept and freed < nbytes:
            pool.free(SMALL, [kept.pop(0)], PREFIX)
            freed += SMALL.nbytes
        return freed

    pool.evictor = evictor
    new = pool.allocate(SMALL, "new", 2, expect=4)
    if floor_blocks:  # the cache keeps its floor: the new run goes to blocks never written
        assert kept == done and new == [done[-1] + 1, done[-1] + 2]
    else:  # the kept blocks go, and the new run (with its claim) lies on the pages they wrote
        assert kept == [] and new == done[:2]
        assert pool.allocate(SMALL, "new", 2, after=new[-1]) == done[2:]
    assert pool.held_by("new") == len(new) + (0 if floor_blocks else 2)


def test_prefault_makes_the_first_blocks_resident_and_counts_them_written(monkeypatch):
    resource = pytest.importorskip("resource")
    big = BlockFormat(layers=4, heads=2, head_dim=64, block_size=16, dtype=torch.float32)  # 64 KiB a block
    pool = BlockPool(1024 * big.nbytes, CPU)  # a first segment of a quarter of the budget: 256 blocks
    assert pool.prefault(big, 512 * big.nbytes) == 256  # the first segment, made for it, and no more
    first = pool.store(big).segments[0]
    tokens = 256 * big.block_size
    assert all(bool((part[:, :, :tokens] == 0).all()) for part in (first.k, first.v))
    # Resident now: writing those blocks again takes (almost) no page faults. The allocator may have
    # handed the segment pages the process already had, so RSS before and after says nothing here.
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for part in (first.k, first.v):
        part[:, :, :tokens].fill_(1.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 0.1 * 256 * big.nbytes / 4096
    assert pool.committed_bytes == 256 * big.nbytes and pool.held_bytes == 0 and pool.free_blocks(big) == 1024
    assert pool.store(big).written == pool.store(big).segments[0].first + 256

    # Written pages count as written: a new run takes them rather than evict the prefix cache's blocks.
    monkeypatch.setattr(block_pool, "KEPT_BEFORE_FRESH_PAGES", 0)  # no floor: only written pages spare them
    small = pool_of(64)
    done = small.allocate(SMALL, "done", 4, expect=4)
    small.share(SMALL, done, PREFIX)
    small.free(SMALL, done, "done")
    assert small.prefault(SMALL, 10 * SMALL.nbytes) == 10
    small.evictor = lambda nbytes: pytest.fail("nothing needed evicting")
    assert small.allocate(SMALL, "new", 2, expect=4) == [done[-1] + 1, done[-1] + 2]


def test_formats_share_one_budget_and_an_empty_store_gives_its_room_back():
    fp8 = BlockFormat(1, 1, 8, 16, torch.float8_e4m3fn)
    pool = BlockPool(4 * KIB, CPU, first_segment_bytes=1 << 20)
    blocks = pool.allocate(SMALL, "a", 4)
    assert pool.committed_bytes == 4 * KIB  # float32 blocks took the whole budget
    assert not pool.can_allocate(fp8, 1)
    with pytest.raises(PoolExhausted):
        pool.allocate(fp8, "b", 1)  # the float32 store still holds its blocks
    pool.free(SMALL, blocks[1:], "a")
    assert not pool.can_allocate(fp8, 1)  # free float32 blocks are no room for another format
    pool.free(SMALL, blocks[:1], "a")
    assert pool.can_allocate(fp8, 1) and pool.allocate(fp8, "b", 1) and pool.committed_bytes <= 4 * KIB
    assert pool.store(SMALL).segments == []
