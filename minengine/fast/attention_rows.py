"""Decode attention through `attention_rows.c`: each row's one query over its cached K/V, read in place.

Through torch a decode row's attention is a dozen dispatches, and rows in the block pool must
first be gathered into one padded tensor (`pooled_rows`); the C kernel writes each row's new
K/V into its slot and attends it over its positions where they lie, one call per layer for
every row of a step. A row's arithmetic depends only on its own query, keys and values, in
position order, so its output is the same bits alone (`attend_one`, a request's own cache) or
beside others (`RowsKernel`, positions listed from block tables), on any thread count.

It serves float32 on the CPU with heads laid out as the caches lay them (a head's positions
`head_dim` apart); `serves` says when, and callers keep torch's path otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from minengine.fast.cpu_kernels import library

_ptr = ctypes.c_void_p  # float and long arrays alike: the C side knows their types


class AttendArgs(ctypes.Structure):
    """attention_rows.c's AttendArgs, field for field."""

    _fields_ = [
        ("rows", ctypes.c_long), ("hq", ctypes.c_long), ("hkv", ctypes.c_long), ("d", ctypes.c_long),
        ("scale", ctypes.c_float), ("threads", ctypes.c_int),
        ("q", _ptr), ("q_rs", ctypes.c_long), ("q_at", _ptr),
        ("k", _ptr), ("v", _ptr), ("k_rs", ctypes.c_long), ("v_rs", ctypes.c_long),
        ("kv_at", _ptr), ("slots", _ptr),
        ("kc", _ptr), ("vc", _ptr), ("kc_hs", ctypes.c_long), ("vc_hs", ctypes.c_long),
        ("pos", _ptr), ("ends", _ptr),
        ("out", _ptr), ("out_rs", ctypes.c_long),
    ]  # fmt: skip


def _heads(t: torch.Tensor, d: int) -> bool:
    """Whether t's last two dims are heads of d contiguous floats, d apart (the kernel's layout)."""
    return t.dtype == torch.float32 and t.stride(-1) == 1 and (t.shape[-2] == 1 or t.stride(-2) == d)


def available() -> bool:
    """Whether the kernel is built here (its library loaded)."""
    return library().lib is not None


def serves(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel runs this attention: float32 CPU tensors, keys/values [Hkv, L, d] with a
    head's positions d apart, and the kernel built here."""
    d = keys.shape[-1]
    return (
        q.device.type == "cpu"
        and _heads(keys, d)
        and _heads(values, d)
        and q.dtype == torch.float32
        and library().lib is not None
    )


def serves_store(store: torch.Tensor) -> bool:
    """Whether `RowsKernel` runs over a K/V store [layers, Hkv, positions, d] (float32, on the CPU)."""
    return store.device.type == "cpu" and store.dtype == torch.float32 and library().lib is not None


def attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One query q [Hq, d] (or grouped [Hkv, Hq/Hkv, d]) over keys/values [Hkv, L, d]: [Hkv, Hq/Hkv, d].

    The caller checked `serves`; `out`, when given, is a contiguous [Hkv, Hq/Hkv, d] float32 buffer.
    """
    hkv, length, d = keys.shape
    q = q.contiguous()
    hq = q.numel() // d
    if out is None:
        out = torch.empty(hkv, hq // hkv, d, dtype=torch.float32)
    ends = ctypes.c_long(length)
    args = AttendArgs(
        rows=1, hq=hq, hkv=hkv, d=d, scale=scale, threads=torch.get_num_threads(),
        q=q.data_ptr(), q_rs=hq * d, kc=keys.data_ptr(), vc=values.data_ptr(),
        kc_hs=keys.stride(0), vc_hs=values.stride(0),
        ends=ctypes.addressof(ends), out=out.data_ptr(), out_rs=hq * d,
    )  # fmt: skip
    library().lib.attend_rows(ctypes.addressof(args))
    return out


class RowsKernel:
    """Decode rows of one step over caches in one K/V store (a pool segment), one call per layer.

    Made once per step (see `serves_store`): `positions[i]` are row i's positions in the store, its new one among
    them at `slots[i]`; `tokens[i]` is its place among the step's stacked k/v, `queries[i]`
    among the q a layer hands in.
    """

    def __init__(
        self,
        positions: Sequence[Sequence[int]],
        slots: Sequence[int],
        tokens: Sequence[int],
        queries: Sequence[int],
        scale: float,
        threads: int,
    ) -> None:
        self.rows = len(positions)
        # The index arrays live as long as the kernel does: the C side reads them by address. Made
        # with numpy: a step of 8 rows lists a thousand positions or more, and Python's lists
        # took 0.2 ms of every step to build them.
        rows = [np.asarray(row, dtype=np.int64) for row in positions]
        self._pos = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
        self._ends = torch.from_numpy(np.cumsum([len(row) for row in rows], dtype=np.int64))
        self._slots = torch.tensor(list(slots), dtype=torch.long)
        self._tokens = torch.tensor(list(tokens), dtype=torch.long)
        self.queries(queries)
        self.args = AttendArgs(
            rows=self.rows, scale=scale, threads=threads, kv_at=self._tokens.data_ptr(),
            slots=self._slots.data_ptr(), pos=self._pos.data_ptr(), ends=self._ends.data_ptr(),
        )  # fmt: skip

    def queries(self, queries: Sequence[int]) -> None:
        """From now on the rows' queries are at `queries` among the q a layer hands in."""
        self._queries = torch.tensor(list(queries), dtype=torch.long)

    def query_ids(self) -> int:
        """The address of the rows' query indices (the C stack sets `args.q_at` itself)."""
        return self._queries.data_ptr()

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor
    ) -> torch.Tensor:
        """Write the rows' k/v [T, Hkv, d] into store_k/store_v [Hkv, positions, d] and attend
        their q [T', Hq, d]: [rows, Hq*d]."""
        hkv, d = store_k.shape[0], store_k.shape[-1]
        q, k, v = (t if _heads(t, d) else t.contiguous() for t in (q, k, v))
        hq = q.shape[1]
        out = torch.empty(self.rows, hq * d, dtype=torch.float32)
        a = self.args
        a.hq, a.hkv, a.d, a.out_rs = hq, hkv, d, hq * d
        a.q_at = self._queries.data_ptr()
        a.q, a.q_rs = q.data_ptr(), q.stride(0)
        a.k, a.k_rs, a.v, a.v_rs = k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)
        a.kc, a.kc_hs, a.vc, a.vc_hs = store_k.data_ptr(), store_k.stride(0), store_v.data_ptr(), store_v.stride(0)
        a.out = out.data_ptr()
        library().lib.attend_rows(ctypes.addressof(a))
        return out


class SlotKernel:
    """One token at `pos` of a request's own cache, layer after layer (the eager decode step): its
    K/V written into their slot and its query attended, with no torch call per layer.

    q, k, v and out are the step's scratch buffers (`transformer.Scratch`: q grouped [Hkv,
    Hq/Hkv, d], k and v [Hkv, d], out like q); keys/values the cache's per-layer [Hkv, capacity, d].
    """

    __slots__ = ("args", "keys", "values", "_slot", "_end", "_call")

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        pos: int,
        scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        scale: float,
    ) -> None:
        q, k, v, out = scratch
        hkv, d = k.shape
        hq = q.numel() // d
        self.keys = [t.data_ptr() for t in keys]
        self.values = [t.data_ptr() for t in values]
        self._slot, self._end = ctypes.c_long(pos), ctypes.c_long(pos + 1)
        self.args = AttendArgs(
            rows=1, hq=hq, hkv=hkv, d=d, scale=scale, threads=1, q=q.data_ptr(), q_rs=hq * d,
            k=k.data_ptr(), v=v.data_ptr(), k_rs=hkv * d, v_rs=hkv * d, slots=ctypes.addressof(self._slot),
            kc_hs=keys[0].stride(0), vc_hs=values[0].stride(0), ends=ctypes.addressof(self._end),
            out=out.data_ptr(), out_rs=hq * d,
        )  # fmt: skip
        self._call = library().lib.attend_rows

    @staticmethod
    def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether the kernel runs this step: float32 CPU buffers in its layout, and the kernel built."""
        d = k.shape[-1]
        return (
            all(t.is_contiguous() for t in (q, k, v, out))
            and keys.device.type == "cpu"
            and _heads(keys, d)
            and all(t.dtype == torch.float32 for t in (q, k, v, out))
            and library().lib is not None
        )

    def __call__(self, layer: int) -> None:
        """Layer `layer`: write the token's K/V into the cache and attend; the result lands in `out`."""
        a = self.args
        a.kc, a.vc = self.keys[layer], self.values[layer]
        self._call(ctypes.addressof(a))
