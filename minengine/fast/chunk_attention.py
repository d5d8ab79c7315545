"""A prompt chunk's attention through `chunk_attention.c`: grouped-query, key-blocked, read where the keys lie.

A chunk of T query positions from `start` attends causally over its cache's start + T positions.
Through SDPA a paged cache is first gathered into one tensor, and each KV head's keys are read
once per query head; the C kernel reads them in place, once per group of query heads, 64 keys
to a block with flash-attention's online softmax, one call per layer. A position's output depends
only on its query and the keys up to it, summed in a fixed order: the same bits however the
prompt was cut into chunks, and whether its cache is contiguous (`attend_chunk`, bound as the
model's prompt attention by `row_ops.model_ops`) or a table of blocks (`PagedChunk`, which a
shared step's chunk row runs: `rows_attention.RowsAttention`).

It runs wherever the kernels built: 16 rows to a vector under AVX-512, 8 under AVX2, where it also
outran SDPA over a whole long prompt (docs/lab/prefill-profile.md).
`available` says whether it is built here, asked once at load.

Beside it, where the build has AVX-512 VNNI, its rounded twin (`attend_chunk_rounded`, `rounded`):
the same units, blocks and online softmax with queries, keys and each block's weights rounded to
int16 so that the scores and the weighted values are exact integer dot products. It is what the
int16 (and int8) activations bind, whose products round their rows already; float32 activations
keep the float kernel's bits (`row_ops.model_ops` chooses, at load).
"""

from __future__ import annotations

import ctypes

import torch

from minengine.fast.cpu_kernels import library
from minengine.kv.paged_cache import PagedKVCache

_ptr = ctypes.c_void_p
_FLOAT = 4  # bytes


class ChunkRun(ctypes.Structure):
    """chunk_attention.h's ChunkRun: positions [start, start + tokens) of head h in layer l at
    k + l * k_ls + h * k_hs + (p - start) * d."""

    _fields_ = [
        ("k", _ptr), ("v", _ptr), ("start", ctypes.c_long), ("tokens", ctypes.c_long),
        ("k_hs", ctypes.c_long), ("v_hs", ctypes.c_long), ("k_ls", ctypes.c_long), ("v_ls", ctypes.c_long),
    ]  # fmt: skip


class ChunkArgs(ctypes.Structure):
    """chunk_attention.h's ChunkArgs, field for field."""

    _fields_ = [
        ("length", ctypes.c_long), ("start", ctypes.c_long),
        ("hq", ctypes.c_long), ("hkv", ctypes.c_long), ("d", ctypes.c_long),
        ("scale", ctypes.c_float), ("threads", ctypes.c_int),
        ("q", _ptr), ("q_rs", ctypes.c_long), ("runs", _ptr), ("n_runs", ctypes.c_long), ("layer", ctypes.c_long),
        ("out", _ptr), ("out_rs", ctypes.c_long), ("rounded", ctypes.c_int),
    ]  # fmt: skip


def available() -> bool:
    """Whether the kernel is built here (with the other C kernels, under AVX-512 or AVX2)."""
    return library().lib is not None


def rounded(d: int) -> bool:
    """Whether the rounded twin runs here for heads of `d` floats: the kernel built with AVX-512 VNNI, and d
    a multiple of 32."""
    return available() and bool(library().lib.chunk_attention_rounded(d))


def _rows(q: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, d] with each position's heads d apart (the kernel's layout), copied only where it is not."""
    d = q.shape[-1]
    if q.dtype != torch.float32:
        raise ValueError(f"the C chunk attention takes float32 queries, not {q.dtype}")
    return q if q.stride(-1) == 1 and (q.shape[1] == 1 or q.stride(1) == d) else q.contiguous()


def _call(args: ChunkArgs) -> None:
    status = library().lib.chunk_attention(ctypes.byref(args))
    if status == 1:
        raise ValueError(f"the rounded chunk attention does not take heads of {args.d} floats on this build")
    if status == 2:
        raise MemoryError("no memory for the rounded chunk attention's keys")


def _run(
    q: torch.Tensor, start: int, hkv: int, scale: float, runs, n_runs: int, layer: int, round_: bool
) -> torch.Tensor:
    """The kernel (its rounded twin where `round_`) over q [T, Hq, d] at positions start.. with keys in
    `runs`: [T, Hq * d]."""
    length, hq, d = q.shape
    out = torch.empty(length, hq * d, dtype=torch.float32)
    args = ChunkArgs(
        length=length, start=start, hq=hq, hkv=hkv, d=d, scale=scale, threads=torch.get_num_threads(),
        q=q.data_ptr(), q_rs=q.stride(0), runs=ctypes.addressof(runs), n_runs=n_runs, layer=layer,
        out=out.data_ptr(), out_rs=hq * d, rounded=int(round_),
    )  # fmt: skip
    _call(args)
    return out


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """`ops.prompt_attention` through the kernel: q [1, Hq, T, d] at positions start.. over k/v
    [1, Hkv, start+T, d] (a head's positions d apart, as a cache's buffer or view lays them),
    causal: [1, Hq, T, d], a view of a [T, Hq, d] tensor."""
    return _attend(q, k, v, start, scale, False)


def attend_chunk_rounded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """`attend_chunk` through the rounded twin (int16 dot products; the module docstring)."""
    if not rounded(q.shape[-1]):
        raise ValueError(f"the rounded chunk attention needs AVX-512 VNNI and a head size a multiple of 32, "
                         f"not {q.shape[-1]}")  # fmt: skip
    return _attend(q, k, v, start, scale, True)


KEYBLOCKED = (attend_chunk, attend_chunk_rounded)  # the prompt attentions that are this kernel


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, round_: bool):
    keys, values = k[0], v[0]
    d = keys.shape[-1]
    if not all(t.dtype == torch.float32 and t.stride(-1) == 1 and t.stride(-2) == d for t in (keys, values)):
        raise ValueError("the C chunk attention reads float32 K/V with a head's positions d apart")
    rows = _rows(q[0].transpose(0, 1))
    run = ChunkRun(k=keys.data_ptr(), v=values.data_ptr(), start=0, tokens=keys.shape[1],
                   k_hs=keys.stride(0), v_hs=values.stride(0))  # fmt: skip
    out = _run(rows, start, keys.shape[0], scale, run, 1, 0, round_)
    length, hq = rows.shape[0], rows.shape[1]
    return out.view(length, hq, d).transpose(0, 1).unsqueeze(0)


def in_place(prompt_attention: object, cache: object) -> bool:
    """Whether a shared step's chunk over `cache` runs as a `PagedChunk`: the model was built with this
    kernel as its prompt attention (`row_ops.model_ops`, at load) and the cache is a table of float32
    blocks holding K/V as the model computes them. Asked once a step, when the step's attention is made."""
    return (
        prompt_attention in KEYBLOCKED
        and isinstance(cache, PagedKVCache)
        and cache.layout == "gqa"
        and cache.storage_dtype == torch.float32
    )


class PagedChunk:
    """One chunk row of a shared step over a paged cache: its K/V written into the cache's blocks and
    its queries attended over the table's runs where they lie, layer after layer, with nothing
    gathered. Made once a step (the runs are read again only when the table grows)."""

    def __init__(self, cache: PagedKVCache, start: int, scale: float, round_: bool = False) -> None:
        self.cache, self.start, self.scale, self.round = cache, start, scale, round_
        self._made: tuple[int, int] | None = None  # (blocks, end) the runs were made for
        self._runs: ctypes.Array | None = None

    def _table(self, end: int) -> ctypes.Array:
        key = (len(self.cache.blocks), end)
        if self._made != key or self._runs is None:
            found = self.cache.runs(end)
            runs = (ChunkRun * len(found))()
            for slot, run in zip(runs, found, strict=True):
                k, v = run.segment.k, run.segment.v
                d = k.shape[-1]
                slot.k, slot.v = k.data_ptr() + run.local * d * _FLOAT, v.data_ptr() + run.local * d * _FLOAT
                slot.start, slot.tokens = run.start, run.tokens
                slot.k_hs, slot.v_hs, slot.k_ls, slot.v_ls = k.stride(1), v.stride(1), k.stride(0), v.stride(0)
            self._runs, self._made = runs, key
        return self._runs

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: int
    ) -> torch.Tensor | None:
        """Write the chunk's k/v [T, Hkv, d] at its positions of `layer`, then attend the queries of
        its last `queries` positions, q [queries, Hq, d] (all T, the last alone, or none): [queries, Hq * d]."""
        length = k.shape[0]
        self.cache.write(layer, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), self.start)
        if queries == 0:
            return None
        end = self.start + length
        runs = self._table(end)
        first = end - queries  # the position of the first query attended
        return _run(_rows(q), first, k.shape[1], self.scale, runs, len(runs), layer, self.round)
