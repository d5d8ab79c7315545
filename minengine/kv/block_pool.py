"""The engine's KV memory: fixed-size blocks under one byte budget, handed out and shared by count.

A block holds `block_size` positions of every layer's K and V in one stored form (a
`BlockFormat`: the stored heads, which the layout decides, and the storage dtype, FP8 with its
per-token scales). Requests choose their layout and storage dtype one by one, and a block of one
form cannot hold another's K/V, so the pool keeps one `BlockStore` per format, all drawing on
one byte budget: a store grows by segments while the budget has room, and a store that holds
nothing gives its segments back when another format needs the room. One budget, because that
is what the user set (the KV budget, half of the free memory by default) and what admission
counts; one store per format, because a block's bytes are only meaningful in its own format,
and splitting the budget between formats up front would waste whichever goes unused.

Storage grows in segments, the first `FIRST_SEGMENT_BYTES` (or what the first need takes),
each next one twice the last, none over a quarter of the budget (so that one format's segments
leave room for another's), never past the budget: the default budget is half of RAM, and
committing it at the first request would take memory a small run never uses (on CUDA it is
really allocated; on the CPU untouched pages cost nothing, but a segment once written stays
resident). Doubling keeps segments few, so most requests find their blocks side by side in one.

Within a segment each layer's K (and V) is one [heads, tokens, head_dim] tensor, blocks end to
end along the tokens, so a request whose blocks are consecutive reads its K/V as one strided
view (`PagedKVCache`), exactly as its own buffer would be read. To keep them consecutive, a
request's first allocation looks for a free run with room for what it expects to hold (its
prompt and max_tokens) and claims the rest of that run: claimed blocks stay free, and others
take them only when nothing unclaimed is left. Later allocations take the block after its last
one when they can, even one the prefix cache alone keeps (it lets go of it: a request that hit a
kept prefix then grows right after it, as it would in a buffer of its own).

Every block has a reference count; its holders are named (a request id, or `PREFIX` for the
prefix cache). A block goes back to the free list when its last holder frees it. The counters
say what is held by whom: `holdings(owner)` splits the budget into this owner's blocks, other
requests', the prefix cache's alone, and free (`PoolUsage` in the engine's batch facts);
`sharing(blocks)` sorts one request's blocks by who else holds them (`BlockSharing`, in its
`KVUsage`).
Thread-safe; allocation calls the prefix cache's evictor (`evictor`) outside the pool's lock.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from minengine.errors import ReqscopeError, Setting
from minengine.kv.arithmetic import MIB, kv_bytes_per_token
from minengine.kv.usage import BlockSharing, PoolUsage

PREFIX = "prefix cache"  # the holder name of the prefix cache's references
FIRST_SEGMENT_BYTES = 256 * MIB
# On the CPU the prefix cache gives up its least recently used blocks, down to this much, rather
# than let a new request's run land on pages never written (see `BlockPool.allocate`).
KEPT_BEFORE_FRESH_PAGES = 64 * MIB
_USED, _FREE, _CLAIMED = 0, 1, 2  # a block's state; 0 also marks the gap between two segments
_ANY_FREE = bytes.maketrans(b"\x02", b"\x01")


@dataclass(frozen=True)
class BlockFormat:
    """What one block stores: `block_size` positions of every layer's K and V, in one stored form."""

    layers: int
    heads: int  # stored heads: the model's KV heads (gqa) or one per query head (mha)
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage

    @property
    def quantized(self) -> bool:
        """FP8 storage, with one float32 scale per position and head."""
        return self.dtype == torch.float8_e4m3fn

    # Made once per format (a frozen dataclass: its fields never change): every token's KV snapshot
    # asks for them (`PagedKVCache.usage`, `BlockPool.sharing`).
    @cached_property
    def payload_bytes(self) -> int:
        """K and V bytes of one block, all layers (the seeds' formula times the block's tokens)."""
        return kv_bytes_per_token(self.layers, self.heads, self.head_dim, self.dtype.itemsize) * self.block_size

    @cached_property
    def nbytes(self) -> int:
        """Bytes one block really takes: the payload and any FP8 scales."""
        scales = 2 * self.layers * self.heads * self.block_size * 4 if self.quantized else 0
        return self.payload_bytes + scales

    @property
    def label(self) -> str:
        """How a message names the format."""
        return f"{self.heads} heads x {self.head_dim}, {str(self.dtype).removeprefix('torch.')}"


class PoolExhausted(ReqscopeError):
    """No free block is left for an allocation, even after evicting the prefix cache's blocks."""

    def __init__(self, owner: str, wanted: int, free: int, fmt: BlockFormat) -> None:
        super().__init__(
            f"the KV pool has no room for {wanted} more blocks of {fmt.label} for {owner} "
            f"({free} free); lower the load or raise ",
            Setting.KV_BUDGET,
        )
        self.owner, self.wanted, self.free = owner, wanted, free


class Segment:
    """One piece of a store's storage: `blocks` blocks numbered from `first`."""

    __slots__ = ("first", "blocks", "k", "v", "k_scale", "v_scale")

    def __init__(self, fmt: BlockFormat, first: int, blocks: int, device: torch.device) -> None:
        self.first, self.blocks = first, blocks
        # Outside inference mode even when a forward pass grows the pool: an inference tensor
        # could never be written again outside one (the prefix cache, a copy on write).
        with torch.inference_mode(False):
            self._allocate(fmt, blocks, device)

    def _allocate(self, fmt: BlockFormat, blocks: int, device: torch.device) -> None:
        shape = (fmt.layers, fmt.heads, blocks * fmt.block_size, fmt.head_dim)
        self.k = torch.empty(shape, dtype=fmt.dtype, device=device)
        self.v = torch.empty(shape, dtype=fmt.dtype, device=device)
        self.k_scale = self.v_scale = None
        if fmt.quantized:
            scales = (fmt.layers, fmt.heads, blocks * fmt.block_size, 1)
            self.k_scale = torch.empty(scales, device=device)
            self.v_scale = torch.empty(scales, device=device)


class BlockStore:
    """The blocks of one format: their segments, which are free or claimed, and their reference counts.

    Blocks are numbered across segments, with one unused number between two segments so that
    no run of free blocks ever spans two. Only `BlockPool` changes a store, under its lock.
    """

    def __init__(self, fmt: BlockFormat, device: torch.device) -> None:
        self.fmt, self.device = fmt, device
        self.segments: list[Segment] = []
        self._firsts: list[int] = []
        self.state = bytearray()  # per block number: _USED, _FREE or _CLAIMED
        self.refs = array("i")  # holders per block, the prefix cache included
        self.prefix = bytearray()  # 1 where the prefix cache is one of them
        self.claims: dict[str, range] = {}
        self.free_blocks = 0  # free blocks, claimed or not
        self.held_blocks = 0
        self.prefix_only_blocks = 0  # held by the prefix cache alone: evicting them frees them
        self.written = 0  # every block below this number was handed out once (on the CPU, its pages are resident)

    @property
    def capacity_blocks(self) -> int:
        """Blocks of every segment."""
        return sum(s.blocks for s in self.segments)

    def segment_of(self, block: int) -> Segment:
        """The segment that holds `block`."""
        return self.segments[bisect.bisect_right(self._firsts, block) - 1]

    def add_segment(self, blocks: int) -> Segment:
        """Grow by `blocks` free blocks, after a gap."""
        self.state.append(_USED)
        self.refs.append(0)
        self.prefix.append(0)
        seg = Segment(self.fmt, len(self.state), blocks, self.device)
        self.state.extend(b"\x01" * blocks)
        self.refs.extend([0] * blocks)
        self.prefix.extend(bytes(blocks))
        self.segments.append(seg)
        self._firsts.append(seg.first)
        self.free_blocks += blocks
        return seg

    def drop_segments(self) -> int:
        """Give back every segment of a store that holds nothing; the bytes given back."""
        assert self.held_blocks == 0
        freed = self.capacity_blocks * self.fmt.nbytes
        self.state[:] = bytes(len(self.state))  # numbers are never reused: no stale view can alias
        self.segments, self._firsts, self.claims, self.free_blocks = [], [], {}, 0
        return freed

    def find_run(self, n: int, *, claimed_too: bool = False, start: int = 0, end: int | None = None) -> int | None:
        """The first block of `n` consecutive free blocks (unclaimed ones unless `claimed_too`),
        all of them below `end` where given."""
        hay = self.state.translate(_ANY_FREE) if claimed_too else self.state
        i = hay.find(b"\x01" * n, start, len(hay) if end is None else end)
        return None if i < 0 else i

    def extends(self, after: int, n: int, owner: str) -> bool:
        """Whether the `n` blocks after block `after` are free for `owner` (unclaimed or its own claim)."""
        claim = self.claims.get(owner, range(0))
        end = after + 1 + n
        if end > len(self.state):
            return False
        return all(self.state[b] == _FREE or (self.state[b] == _CLAIMED and b in claim) for b in range(after + 1, end))

    def scattered(self, n: int) -> list[int]:
        """`n` free blocks wherever they are, unclaimed ones first (the caller checked there are `n`)."""
        out: list[int] = []
        for wanted in (_FREE, _CLAIMED):
            i = self.state.find(wanted)
            while i >= 0 and len(out) < n:
                out.append(i)
                i = self.state.find(wanted, i + 1)
        return out[:n]

    def claim(self, owner: str, blocks: range) -> None:
        """Mark the free blocks of `blocks` as expected by `owner`."""
        self.unclaim(owner)
        for b in blocks:
            if self.state[b] == _FREE:
                self.state[b] = _CLAIMED
        self.claims[owner] = blocks

    def unclaim(self, owner: str) -> None:
        """Forget `owner`'s claim: its blocks still free are anyone's again."""
        for b in self.claims.pop(owner, range(0)):
            if self.state[b] == _CLAIMED:
                self.state[b] = _FREE


class BlockPool:
    """Every request's KV blocks and the prefix cache's, within one byte budget; thread-safe."""

    def __init__(
        self, budget_bytes: int, device: torch.device, *, first_segment_bytes: int | None = None
    ) -> None:
        """A pool of `budget_bytes`. Its first segment is `first_segment_bytes`; by default
        `FIRST_SEGMENT_BYTES` on a GPU, where a segment is memory taken, and a quarter of the budget
        on the CPU, where its untouched pages cost nothing: there the running requests' blocks then
        share one segment, which the decode rows' C stack reads in place (a step over rows in two
        segments runs the Python blocks)."""
        self.budget_bytes = budget_bytes
        self.device = device
        if first_segment_bytes is None:
            cpu = device.type == "cpu"
            first_segment_bytes = max(FIRST_SEGMENT_BYTES, budget_bytes // 4) if cpu else FIRST_SEGMENT_BYTES
        self.first_segment_bytes = first_segment_bytes
        self.evictor: Callable[[int], int] | None = None  # frees kept blocks on demand (the prefix cache)
        # Lets go of one kept block, if the prefix cache alone holds it (see `allocate`).
        self.reclaimer: Callable[[BlockFormat, int], bool] | None = None
        self._stores: dict[BlockFormat, BlockStore] = {}
        self._lock = threading.RLock()
        self._owned: Counter[str] = Counter()  # blocks per holder
        self._owned_bytes: Counter[str] = Counter()
        # The counters below are the pool's alone to write; readers take them as they stand.
        self.held_bytes = 0  # blocks with any holder, each once
        self.request_bytes = 0  # blocks at least one request holds, each once
        self.prefix_only_bytes = 0  # blocks only the prefix cache holds
        self.shared_blocks = 0  # blocks with two holders or more
        self.committed_bytes = 0  # every segment's bytes
        # References taken or dropped so far: who shares a cache's blocks (`sharing`) changes only with it.
        self.changes = 0

    # -- counters -------------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        """Budget no block takes (free blocks and storage not yet allocated)."""
        return self.budget_bytes - self.held_bytes

    def held_by(self, owner: str) -> int:
        """Blocks `owner` holds."""
        return self._owned[owner]

    def held_bytes_by(self, owner: str) -> int:
        """Bytes of the blocks `owner` holds."""
        return self._owned_bytes[owner]

    def holders(self) -> dict[str, int]:
        """Blocks held per holder (the prefix cache as `PREFIX`), holders with none left out."""
        with self._lock:
            return {owner: n for owner, n in self._owned.items() if n}

    def holdings(self, owner: str) -> PoolUsage:
        """The budget as `owner` sees it: its blocks, other requests', the prefix cache's alone, free."""
        with self._lock:
            own = self._owned_bytes[owner]
            return PoolUsage(self.budget_bytes, own, self.request_bytes - own, self.prefix_only_bytes)

    def sharing(self, fmt: BlockFormat, blocks: Sequence[int]) -> BlockSharing:
        """One request's `blocks` by who else holds them: no one, another request, or the prefix cache only."""
        own = with_requests = with_prefix = 0
        with self._lock:
            store = self.store(fmt)
            for b in blocks:
                refs, in_prefix = store.refs[b], store.prefix[b]
                if refs == 1:
                    own += 1
                elif refs - in_prefix > 1:
                    with_requests += 1
                else:
                    with_prefix += 1
        return BlockSharing(own, with_requests, with_prefix, fmt.nbytes)

    def store(self, fmt: BlockFormat) -> BlockStore:
        """The store of `fmt`'s blocks (made empty on first use: no storage until a block is wanted)."""
        with self._lock:
            store = self._stores.get(fmt)
            if store is None:
                store = self._stores[fmt] = BlockStore(fmt, self.device)
            return store

    def free_blocks(self, fmt: BlockFormat) -> int:
        """Blocks of `fmt` that could be allocated now without evicting: free ones, and the room left to grow."""
        with self._lock:
            store = self.store(fmt)
            return store.free_blocks + (self.budget_bytes - self.committed_bytes) // fmt.nbytes

    def can_allocate(self, fmt: BlockFormat, blocks: int) -> bool:
        """Whether `blocks` blocks of `fmt` fit now, evicting what `allocate` would evict: the
        prefix cache's blocks, and with them the storage of another format's store that holds
        nothing else."""
        with self._lock:
            store = self.store(fmt)
            room = self.budget_bytes - self.committed_bytes + sum(
                s.capacity_blocks * s.fmt.nbytes
                for f, s in self._stores.items()
                if f != fmt and s.held_blocks == s.prefix_only_blocks
            )
            within = self.budget_bytes - self.held_bytes + self.prefix_only_bytes >= blocks * fmt.nbytes
            return within and store.free_blocks + store.prefix_only_blocks + room // fmt.nbytes >= blocks

    def held_by_requests(self, fmt: BlockFormat, blocks: Sequence[int]) -> int:
        """How many of `blocks` some request holds (the rest, held by the prefix cache alone,
        `can_allocate` already counts as room it may evict)."""
        store = self.store(fmt)
        with self._lock:
            return sum(1 for b in blocks if store.refs[b] > store.prefix[b])

    # -- allocation -----------------------------------------------------------------------------

    def allocate(
        self, fmt: BlockFormat, owner: str, count: int, *, after: int | None = None, expect: int = 0
    ) -> list[int]:
        """`count` new blocks of `fmt` for `owner`, each with one reference (its).

        `after` is the owner's last block: the new ones follow it when they are free. Otherwise
        they start a run with room for `expect` blocks (what the owner expects to need from here
        on), whose rest is claimed for it. Evicts the prefix cache's blocks when nothing is free; raises
        `PoolExhausted` when even that leaves too little.
        """
        store = self.store(fmt)
        self._written_pages_first(store, owner, count, after, expect)
        if after is not None and self.reclaimer is not None:
            # The blocks after the owner's last one, kept by the prefix cache alone, are worth more
            # to it than to the cache: without them its table splits, and every step gathers it.
            for b in self._kept_after(store, after, count):
                self.reclaimer(fmt, b)
        while True:
            with self._lock:
                within = self.held_bytes + count * fmt.nbytes <= self.budget_bytes  # the budget may have shrunk
                blocks = self._place(store, owner, count, after, expect) if within else None
                if blocks is not None:
                    for b in blocks:
                        store.state[b] = _USED
                        store.free_blocks -= 1
                        self._ref(store, b, owner)
                    store.written = max(store.written, max(blocks, default=-1) + 1)
                    return blocks
                short = max(
                    (count - store.free_blocks) * fmt.nbytes - (self.budget_bytes - self.committed_bytes),
                    self.held_bytes + count * fmt.nbytes - self.budget_bytes,
                )
                if self._drop_empty_stores(fmt):
                    continue
            freed = self.evictor(max(short, fmt.nbytes)) if self.evictor is not None else 0
            if not freed:
                with self._lock:
                    if not self._drop_empty_stores(fmt):
                        raise PoolExhausted(owner, count, store.free_blocks, fmt)

    def _written_pages_first(self, store: BlockStore, owner: str, count: int, after: int | None, expect: int) -> None:
        """On the CPU, before a new run (none follows `after`, a prefix hit's last block included)
        would land on pages never written: evict the prefix cache's least recently used blocks (down
        to `KEPT_BEFORE_FRESH_PAGES`) until a free run of written blocks opens. A first write to a
        page costs a fault and a zeroed page, and a cache that only grows kept every request on fresh
        pages (measured: docs/serving.md, "Written pages first")."""
        if self.device.type != "cpu" or self.evictor is None:
            return
        with self._lock:
            if after is not None and store.extends(after, count, owner):
                return
        run = max(count, expect)
        fmt = store.fmt
        for _ in range(2):  # a run opens once a finished request's blocks go; fragments get no more
            with self._lock:
                if store.find_run(run, end=store.written) is not None or store.written < run:
                    return
                spare = self.prefix_only_bytes - KEPT_BEFORE_FRESH_PAGES
            if spare < fmt.nbytes or not self.evictor(min(spare, run * fmt.nbytes)):
                return

    def prefault(self, fmt: BlockFormat, nbytes: int) -> int:
        """On the CPU, write the first `nbytes` of `fmt`'s blocks now (making its first segment where
        it has none), so that the requests that first take them do not pay the first write to each
        page inside a step; the blocks written (none off the CPU, where storage is real at once).

        A block is a page in each layer's K and V of each head, so 32 sequences entering fresh
        blocks in one decode step took thousands of faults there (docs/serving.md, "Pages written
        at start"). The blocks stay free: this only makes their pages resident."""
        if self.device.type != "cpu":
            return 0
        with self._lock:
            store = self.store(fmt)
            first = store.segments[0] if store.segments else self._grow(store, 1)
            if first is None:
                return 0
            blocks = min(first.blocks, nbytes // fmt.nbytes)
            tokens = blocks * fmt.block_size
            for part in (first.k, first.v, first.k_scale, first.v_scale):
                if part is not None:
                    part[:, :, :tokens].zero_()
            store.written = max(store.written, first.first + blocks)
            return blocks

    def _kept_after(self, store: BlockStore, after: int, count: int) -> list[int]:
        """The blocks of the `count` after `after` that only the prefix cache holds, when every
        other one of them is free (else taking them would not keep the table in one run)."""
        with self._lock:
            wanted = range(after + 1, min(after + 1 + count, len(store.state)))
            kept = [b for b in wanted if store.refs[b] == 1 and store.prefix[b]]
            free = sum(1 for b in wanted if store.state[b] != _USED)
            return kept if kept and len(wanted) == count and len(kept) + free == count else []

    def share(self, fmt: BlockFormat, blocks: Sequence[int], owner: str) -> None:
        """Give `owner` a reference to each of `blocks` (held by someone already)."""
        store = self.store(fmt)
        with self._lock:
            for b in blocks:
                if store.refs[b] <= 0:
                    raise ValueError(f"block {b} is free: only a held block can be shared")
                self._ref(store, b, owner)

    def free(self, fmt: BlockFormat, blocks: Sequence[int], owner: str) -> int:
        """Drop `owner`'s reference to each of `blocks`; the blocks that went back to the free list."""
        store = self.store(fmt)
        returned = 0
        with self._lock:
            for b in blocks:
                if self._unref(store, b, owner):
                    store.state[b] = _FREE
                    store.free_blocks += 1
                    returned += 1
        return returned

    def unclaim(self, fmt: BlockFormat, owner: str) -> None:
        """Forget the run `owner` expected to grow into (its cache is released)."""
        with self._lock:
            self.store(fmt).unclaim(owner)

    def refs(self, fmt: BlockFormat, block: int) -> int:
        """Holders of `block` now."""
        return self.store(fmt).refs[block]

    def _place(self, store: BlockStore, owner: str, count: int, after: int | None, expect: int) -> list[int] | None:
        if after is not None and store.extends(after, count, owner):
            return list(range(after + 1, after + 1 + count))
        wanted = [max(count, expect), count]  # a run with room to grow, else one for now
        for n in wanted:
            start = store.find_run(n)
            if start is not None:
                return self._claimed(store, owner, start, count, n)
        grown = self._grow(store, max(wanted))
        if grown is not None:
            return self._claimed(store, owner, grown.first, count, min(max(wanted), grown.blocks))
        start = store.find_run(count, claimed_too=True)
        if start is not None:
            return list(range(start, start + count))
        if store.free_blocks < count:
            room = (self.budget_bytes - self.committed_bytes) // store.fmt.nbytes
            if room <= 0 or store.free_blocks + room < count:
                return None
            self._add_segment(store, room)
        return store.scattered(count)

    def _claimed(self, store: BlockStore, owner: str, start: int, count: int, run: int) -> list[int]:
        if run > count:
            store.claim(owner, range(start + count, start + run))
        return list(range(start, start + count))

    def _grow(self, store: BlockStore, need: int) -> Segment | None:
        """A new segment with room for `need` blocks, when the budget has it."""
        fmt = store.fmt
        room = (self.budget_bytes - self.committed_bytes) // fmt.nbytes
        # A quarter of the budget at most, unless one need takes more.
        size = min(max(need, (self.first_segment_bytes << len(store.segments)) // fmt.nbytes),
                   max(need, self.budget_bytes // 4 // fmt.nbytes))  # fmt: skip
        if room < need:
            return None
        return self._add_segment(store, min(size, room))

    def _add_segment(self, store: BlockStore, blocks: int) -> Segment:
        self.committed_bytes += blocks * store.fmt.nbytes
        return store.add_segment(blocks)

    def _drop_empty_stores(self, keep: BlockFormat) -> bool:
        dropped = 0
        for fmt, store in self._stores.items():
            if fmt != keep and store.segments and not store.held_blocks:
                dropped += store.drop_segments()
        self.committed_bytes -= dropped
        return dropped > 0

    def _ref(self, store: BlockStore, b: int, owner: str) -> None:
        self.changes += 1
        nb = store.fmt.nbytes
        refs, in_prefix = store.refs[b], store.prefix[b]
        requests = refs - in_prefix
        if owner == PREFIX:
            if in_prefix:
                raise ValueError(f"the prefix cache holds block {b} already")
            store.prefix[b] = 1
            if not requests:
                self.prefix_only_bytes += nb
                store.prefix_only_blocks += 1
        elif not requests:
            self.request_bytes += nb
            if in_prefix:
                self.prefix_only_bytes -= nb
                store.prefix_only_blocks -= 1
        store.refs[b] = refs + 1
        if refs == 0:
            self.held_bytes += nb
            store.held_blocks += 1
        elif refs == 1:
            self.shared_blocks += 1
        self._owned[owner] += 1
        self._owned_bytes[owner] += nb

    def _unref(self, store: BlockStore, b: int, owner: str) -> bool:
        """Drop one reference of `owner`'s; whether the block is free now."""
        self.changes += 1
        nb = store.fmt.nbytes
        refs, in_prefix = store.refs[b], store.prefix[b]
        if refs <= 0 or (owner == PREFIX and not in_prefix) or (owner != PREFIX and refs - in_prefix <= 0):
            raise ValueError(f"{owner} holds no reference to block {b}")
        requests = refs - in_prefix
        if owner == PREFIX:
            store.prefix[b] = 0
            if not requests:
                self.prefix_only_bytes -= nb
                store.prefix_only_blocks -= 1
        elif requests == 1:
            self.request_bytes -= nb
            if in_prefix:
                self.prefix_only_bytes += nb
                store.prefix_only_blocks += 1
        store.refs[b] = refs - 1
        if refs == 1:
            self.held_bytes -= nb
            store.held_blocks -= 1
        elif refs == 2:
            self.shared_blocks -= 1
        self._owned[owner] -= 1
        self._owned_bytes[owner] -= nb
        return refs == 1
