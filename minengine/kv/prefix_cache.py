"""Automatic prefix caching: full KV blocks kept after their request ends, reused by the next
request whose prompt starts with the same tokens (vLLM's automatic prefix caching, in an engine
that runs one request at a time).

A block is named by a hash chained over its parent block's name and its own token ids, so two
equal names mean two equal prefixes, not merely two equal blocks. The chain starts from a hash
of everything besides the tokens that decides what K/V a block holds (`KVIdentity`: the model,
its compute dtype and device, the KV layout, the KV storage dtype and the block size), so a
block made under any other of these never matches: it is skipped, never used for a wrong result.

A request looks up its prompt's full blocks, the first miss ending the hit; the last prompt
token is never covered, so prefill always computes at least one position and its logits exist
(vLLM's rule too). Kept blocks are copies (`KVSpan`, one per block) outside any request's cache:
a request's cache is one buffer per layer reserved for its whole budget, or the static decoder's
arena, so blocks cannot be shared in place; the hit is copied into the new cache instead, which
costs far less than recomputing it (see `RequestSession._prefix_cache` for measured numbers).
FP8 storage is kept with its scales, byte for byte, so every storage and layout is served.

Kept blocks count against the scheduler's KV budget: an admission that needs room evicts them
least recently used first (`evict`), and a finished request's new blocks are stored only within
the room its budget leaves (`store`). Blocks of one chain are ordered so that its last block is
evicted before its first: a block whose parent is gone can never be reached again.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import astuple, dataclass

from minengine.kv.cache import KVCache, KVSpan


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


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found: the cached prefix of a prompt, in blocks, ready to copy in.

    `spans` are the kept blocks themselves, held by the hit, so a block evicted after the lookup
    is still copied whole.
    """

    identity: KVIdentity
    looked_up: int  # the prompt's full blocks a hit may cover (all but the last prompt token)
    spans: tuple[KVSpan, ...]  # the hit blocks, in order
    lookup_ms: float

    @property
    def blocks(self) -> int:
        """Blocks found."""
        return len(self.spans)

    @property
    def tokens(self) -> int:
        """Prompt tokens the hit covers (whole blocks)."""
        return self.blocks * self.identity.block_size


@dataclass(frozen=True)
class FreshBlocks:
    """A finished request's full blocks: the chain's hashes, and copies of those not kept yet."""

    chain: tuple[bytes, ...]
    new: tuple[tuple[bytes, KVSpan], ...]


class PrefixCache:
    """Kept KV blocks by chained hash, least recently used first; thread-safe.

    Lock order: the scheduler's lock, then this one (`evict` and `store` run under the former).
    """

    def __init__(self) -> None:
        self._blocks: OrderedDict[bytes, KVSpan] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted_blocks = 0  # blocks dropped to make room, since the start

    @property
    def kept_bytes(self) -> int:
        """Bytes of every kept block (K, V and any FP8 scales)."""
        return self._bytes

    @property
    def kept_blocks(self) -> int:
        """Blocks kept now, of every identity."""
        return len(self._blocks)

    def lookup(self, ids: Sequence[int], identity: KVIdentity) -> PrefixHit:
        """The longest kept prefix of the prompt `ids`, in whole blocks; the hit becomes most recently used."""
        start = time.perf_counter()
        usable = (len(ids) - 1) // identity.block_size  # the last prompt token is always computed
        hashes = block_hashes(ids, identity, usable)
        spans: list[KVSpan] = []
        with self._lock:
            for h in hashes:
                span = self._blocks.get(h)
                if span is None:
                    break
                spans.append(span)
            self._touch(hashes[: len(spans)])
        return PrefixHit(identity, usable, tuple(spans), (time.perf_counter() - start) * 1000)

    def copy_out(self, cache: KVCache, tokens: Sequence[int], identity: KVIdentity) -> FreshBlocks:
        """The full blocks `cache` holds for `tokens` (its positions' ids, in order), copying out
        those not kept yet. Call it before the cache is released; `store` keeps them."""
        held = min(cache.valid_tokens, len(tokens))
        chain = block_hashes(tokens, identity, held // identity.block_size)
        with self._lock:
            missing = [i for i, h in enumerate(chain) if h not in self._blocks]
        if not missing:
            return FreshBlocks(tuple(chain), ())
        size, first = identity.block_size, missing[0]
        # One stacked copy of everything from the first missing block on, then a block each.
        span = cache.read_span(first * size, len(chain) * size)
        new = tuple((chain[i], span.piece((i - first) * size, size)) for i in missing)
        return FreshBlocks(tuple(chain), new)

    def store(self, fresh: FreshBlocks, room: int) -> int:
        """Keep `fresh`'s new blocks, first to last, while the kept bytes stay within `room`;
        older blocks are evicted for them, least recently used first. Returns the blocks stored."""
        chain = set(fresh.chain)
        stored = 0
        with self._lock:
            for h, span in fresh.new:
                if h in self._blocks:  # kept meanwhile by another request
                    continue
                self._evict(self._bytes + span.nbytes - room, spare=chain)
                if self._bytes + span.nbytes > room:
                    break  # without this block, the ones after it could never be reached
                self._blocks[h] = span
                self._bytes += span.nbytes
                stored += 1
            self._touch([h for h in fresh.chain if h in self._blocks])
        return stored

    def evict(self, nbytes: int) -> int:
        """Drop least recently used blocks until `nbytes` are freed (or none is left); the bytes freed."""
        with self._lock:
            return self._evict(nbytes)

    def clear(self) -> None:
        """Drop every kept block."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def _evict(self, nbytes: int, spare: set[bytes] | None = None) -> int:
        freed = 0
        if nbytes <= 0:
            return 0
        for h in [h for h in self._blocks if not spare or h not in spare]:
            if freed >= nbytes:
                break
            span = self._blocks.pop(h)
            self._bytes -= span.nbytes
            freed += span.nbytes
            self.evicted_blocks += 1
        return freed

    def _touch(self, chain: Sequence[bytes]) -> None:
        # Most recently used last; a chain's first block goes last, so its tail is evicted first.
        for h in reversed(chain):
            self._blocks.move_to_end(h)
