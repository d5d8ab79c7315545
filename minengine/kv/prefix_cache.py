"""Automatic prefix caching: full KV blocks kept after their request ends, reused by the next
request whose prompt starts with the same tokens (vLLM's automatic prefix caching).

A block is named by a hash chained over its parent block's name and its own token ids, so two
equal names mean two equal prefixes, not merely two equal blocks. The chain starts from a hash
of everything besides the tokens that decides what K/V a block holds (`KVIdentity`: the model,
its compute dtype and device, the KV layout, the KV storage dtype and the block size), so a
block made under any other of these never matches: it is skipped, never used for a wrong result.

A request looks up its prompt's full blocks, the first miss ending the hit; the last prompt
token is never covered, so prefill always computes at least one position and its logits exist
(vLLM's rule too). Kept blocks are blocks of the engine's `BlockPool`, held under the name
`PREFIX`: a finished request's paged cache hands its full blocks over by reference, with no copy,
and a hit shares them with the next request by reference (`PagedKVCache.attach_prefix`); since
only full blocks are kept and the prompt's last token is always computed, no request ever writes
into a block it shares. A request-owned cache (the static decoder's arena) cannot hold pool
blocks, so its blocks are copied into pool blocks when it ends (`fresh_blocks`) and a hit is
copied into it (`PrefixHit.span`). FP8 storage is kept with its scales, byte for byte, so
every storage and layout is served.

Kept blocks count against the KV budget: an admission that needs room evicts them least
recently used first (`evict`), the pool evicts them when an allocation finds no free block
(`BlockPool.evictor`) or when a request grows into the block right after its own last one
(`let_go`), and a finished request's new blocks are kept only within the room its
budget leaves (`store`). Blocks of one chain are ordered so that its last block is evicted
before its first: a block whose parent is gone can never be reached again. Evicting a block a
running request also holds frees nothing until that request lets go.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import torch

from minengine.kv.block_pool import PREFIX, BlockFormat, BlockPool, PoolExhausted
from minengine.kv.cache import KVCache, KVSpan
from minengine.kv.paged_cache import PagedKVCache


@dataclass(frozen=True)
class KVIdentity:
    """Everything besides the tokens that decides what K/V a block holds."""

    model: str  # the loaded model: its folder, config and weight files (see `Engine`)
    dtype: str  # compute dtype
    device: str
    layout: str  # gqa or mha
    storage_dtype: str  # KV storage, FP8 included
    block_size: int
    weights: str = "float32"  # the projections' storage format: it moves every K/V value

    def root(self) -> bytes:
        """The hash every block chain of this identity starts from."""
        return hashlib.sha256(repr(astuple(self)).encode()).digest()


def block_hashes(ids: Sequence[int], identity: KVIdentity, blocks: int) -> list[bytes]:
    """The chained hashes of the first `blocks` full blocks of `ids`."""
    size = identity.block_size
    if blocks * size > len(ids):
        raise ValueError(f"{len(ids)} tokens hold fewer than {blocks} full blocks of {size}")
    parent, out = identity.root(), []
    for b in range(blocks):
        parent = hashlib.sha256(parent + array("q", ids[b * size : (b + 1) * size]).tobytes()).digest()
        out.append(parent)
    return out


class PrefixHit:
    """What a lookup found: the cached prefix of a prompt, in pool blocks.

    A hit made for a holder keeps a reference to each of its blocks under that name until
    `release` (its cache shares them first), so a block evicted after the lookup is still whole.
    """

    def __init__(
        self,
        identity: KVIdentity,
        looked_up: int,
        kept: Sequence[tuple[BlockFormat, int]],
        lookup_ms: float,
        pool: BlockPool | None = None,
        holder: str | None = None,
    ) -> None:
        self.identity = identity
        self.looked_up = looked_up  # the prompt's full blocks a hit may cover (all but the last prompt token)
        self.format = kept[0][0] if kept else None
        self.block_ids = tuple(b for _, b in kept)  # the hit blocks, in order
        self.lookup_ms = lookup_ms
        self._pool, self._holder = pool, holder

    @property
    def blocks(self) -> int:
        """Blocks found."""
        return len(self.block_ids)

    @property
    def tokens(self) -> int:
        """Prompt tokens the hit covers (whole blocks)."""
        return self.blocks * self.identity.block_size

    def span(self) -> KVSpan:
        """The hit's K/V copied out of the pool, for a cache that cannot share blocks."""
        if self.format is None or self._pool is None:
            raise ValueError("an empty hit, or one that holds no blocks, has nothing to copy")
        store, size = self._pool.store(self.format), self.format.block_size
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for b in self.block_ids:
            seg = store.segment_of(b)
            local = (b - seg.first) * size
            for out, t in zip(parts, (seg.k, seg.v, seg.k_scale, seg.v_scale), strict=True):
                if t is not None:
                    out.append(t.narrow(2, local, size))
        keys, values, key_scales, value_scales = (torch.cat(p, dim=2) if p else None for p in parts)
        return KVSpan(keys, values, key_scales, value_scales)

    def release(self) -> None:
        """Let go of the hit's references (again is a no-op)."""
        if self._pool is not None and self._holder is not None and self.block_ids:
            self._pool.free(self.format, self.block_ids, self._holder)
        self._holder = None


@dataclass(frozen=True)
class FreshBlocks:
    """A finished request's full blocks: the chain's hashes, and its blocks not kept yet.

    `new` blocks are the request's own (shared on `store`) or, for a request-owned cache, copies
    the prefix cache already holds (`held`).
    """

    chain: tuple[bytes, ...]
    format: BlockFormat | None
    new: tuple[tuple[bytes, int], ...]
    held: bool = False


class PrefixCache:
    """Kept KV blocks by chained hash, least recently used first; thread-safe.

    Lock order: the scheduler's lock, then this one (`evict` and `store` run under the former),
    then the pool's.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._blocks: OrderedDict[bytes, tuple[BlockFormat, int]] = OrderedDict()  # least recently used first
        self._hash_of: dict[tuple[BlockFormat, int], bytes] = {}
        self.kept_bytes = 0  # every kept block's bytes (K, V and any FP8 scales); ours alone to write
        self._lock = threading.Lock()
        self.evicted_blocks = 0  # blocks dropped to make room, since the start
        pool.evictor = self.evict
        pool.reclaimer = self.let_go

    @property
    def kept_blocks(self) -> int:
        """Blocks kept now, of every identity."""
        return len(self._blocks)

    def lookup(self, ids: Sequence[int], identity: KVIdentity, holder: str | None = None) -> PrefixHit:
        """The longest kept prefix of the prompt `ids`, in whole blocks; the hit becomes most
        recently used. With a `holder` the hit holds its blocks under that name until released."""
        start = time.perf_counter()
        hashes = self.prompt_hashes(ids, identity)
        with self._lock:
            kept = self._kept(hashes)
            self._touch(hashes[: len(kept)])
            if holder is not None and kept:
                self.pool.share(kept[0][0], [b for _, b in kept], holder)
        return PrefixHit(identity, len(hashes), kept, (time.perf_counter() - start) * 1000, self.pool, holder)

    @staticmethod
    def prompt_hashes(ids: Sequence[int], identity: KVIdentity) -> list[bytes]:
        """The hashes of the prompt's blocks a lookup may hit: its full blocks, short of the last
        token (always computed, so its logits exist)."""
        return block_hashes(ids, identity, (len(ids) - 1) // identity.block_size)

    def shared_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        """Of the blocks a lookup of the prompt with these `prompt_hashes` would hit now, those a
        request holds too, touching nothing and holding nothing: what a request waiting for
        admission asks, again and again, of blocks it must not pin. A hit block only the cache
        holds saves it nothing there, because `BlockPool.can_allocate` already counts that block
        as room it could evict."""
        with self._lock:
            kept = self._kept(hashes)
            return self.pool.held_by_requests(kept[0][0], [b for _, b in kept]) if kept else 0

    def _kept(self, hashes: Sequence[bytes]) -> list[tuple[BlockFormat, int]]:
        """Under the lock: the kept blocks of the longest run of `hashes` from the first."""
        kept: list[tuple[BlockFormat, int]] = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            kept.append(block)
        return kept

    def fresh_blocks(self, cache: KVCache | PagedKVCache, tokens: Sequence[int], identity: KVIdentity) -> FreshBlocks:
        """The full blocks `cache` holds for `tokens` (its positions' ids, in order) not kept yet.

        A paged cache's blocks are handed over as they are; a request-owned cache's are copied
        into pool blocks (none when the pool has no room). Call it before the cache is
        released; `store` keeps them.
        """
        held = min(cache.valid_tokens, len(tokens))
        chain = block_hashes(tokens, identity, held // identity.block_size)
        with self._lock:
            missing = [i for i, h in enumerate(chain) if h not in self._blocks]
        if isinstance(cache, PagedKVCache):
            return FreshBlocks(tuple(chain), cache.format, tuple((chain[i], cache.blocks[i]) for i in missing))
        fmt = BlockFormat(cache.cfg.num_hidden_layers, cache.heads, cache.cfg.head_dim, cache.block_size,
                          cache.storage_dtype)  # fmt: skip
        if not missing:
            return FreshBlocks(tuple(chain), fmt, ())
        try:
            copies = self.pool.allocate(fmt, PREFIX, len(missing))
        except PoolExhausted:
            return FreshBlocks(tuple(chain), fmt, ())
        size, first = identity.block_size, missing[0]
        # One stacked copy of everything from the first missing block on, then a block each.
        span = cache.read_span(first * size, len(chain) * size)
        store = self.pool.store(fmt)
        for i, b in zip(missing, copies, strict=True):
            seg = store.segment_of(b)
            piece = span.piece((i - first) * size, size)
            local = (b - seg.first) * size
            for dst, src in zip((seg.k, seg.v, seg.k_scale, seg.v_scale), (piece.keys, piece.values,
                                piece.key_scales, piece.value_scales), strict=True):  # fmt: skip
                if dst is not None:
                    dst.narrow(2, local, size).copy_(src)
        return FreshBlocks(tuple(chain), fmt, tuple((chain[i], b) for i, b in zip(missing, copies, strict=True)), True)

    def store(self, fresh: FreshBlocks, room: int) -> int:
        """Keep `fresh`'s new blocks, first to last, while the kept bytes stay within `room`;
        older blocks are evicted for them, least recently used first. Returns the blocks stored."""
        chain = set(fresh.chain)
        stored = 0
        with self._lock:
            for n, (h, block) in enumerate(fresh.new):
                nbytes = fresh.format.nbytes
                if h in self._blocks:  # kept meanwhile by another request
                    if fresh.held:
                        self.pool.free(fresh.format, [block], PREFIX)
                    continue
                self._evict(self.kept_bytes + nbytes - room, spare=chain)
                if self.kept_bytes + nbytes > room:
                    if fresh.held:  # without this block, the ones after it could never be reached
                        self.pool.free(fresh.format, [b for _, b in fresh.new[n:]], PREFIX)
                    break
                if not fresh.held:
                    self.pool.share(fresh.format, [block], PREFIX)
                self._blocks[h] = (fresh.format, block)
                self._hash_of[fresh.format, block] = h
                self.kept_bytes += nbytes
                stored += 1
            self._touch([h for h in fresh.chain if h in self._blocks])
        return stored

    def evict(self, nbytes: int) -> int:
        """Drop least recently used blocks until `nbytes` are freed (or none is left); the bytes freed."""
        with self._lock:
            return self._evict(nbytes)

    def clear(self) -> None:
        """Drop every kept block, and stop serving the pool as its evictor."""
        with self._lock:
            for fmt, block in self._blocks.values():
                self.pool.free(fmt, [block], PREFIX)
            self._blocks.clear()
            self._hash_of.clear()
            self.kept_bytes = 0
        if self.pool.evictor == self.evict:
            self.pool.evictor = None
        if self.pool.reclaimer == self.let_go:
            self.pool.reclaimer = None

    def let_go(self, fmt: BlockFormat, block: int) -> bool:
        """Drop the kept `block` if it is one (the pool wants it for the request growing into it)."""
        with self._lock:
            h = self._hash_of.get((fmt, block))
            if h is None or self.pool.refs(fmt, block) != 1:
                return False
            self._drop(h)
            return True

    def _evict(self, nbytes: int, spare: set[bytes] | None = None) -> int:
        freed = 0
        if nbytes <= 0:
            return 0
        for h in [h for h in self._blocks if not spare or h not in spare]:
            if freed >= nbytes:
                break
            freed += self._drop(h)
        return freed

    def _drop(self, h: bytes) -> int:
        fmt, block = self._blocks.pop(h)
        del self._hash_of[fmt, block]
        self.pool.free(fmt, [block], PREFIX)
        self.kept_bytes -= fmt.nbytes
        self.evicted_blocks += 1
        return fmt.nbytes

    def _touch(self, chain: Sequence[bytes]) -> None:
        # Most recently used last; a chain's first block goes last, so its tail is evicted first.
        for h in reversed(chain):
            self._blocks.move_to_end(h)
