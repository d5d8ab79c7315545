"""The C decode-attention kernel (`attention_rows`) against float64 softmax attention.

One query position over cached keys/values: for head sizes on the vector path and off it, for
grouped, multi-head and multi-query layouts, from one key to long contexts. Rows attended
together read their positions where they lie, write their new K/V into their slots, and come
out the same bits as each row alone, on any thread count.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from minengine.fast.attention_rows import AttendArgs, RowsKernel, SlotKernel, attend_one, serves
from minengine.fast.cpu_kernels import library

pytestmark = pytest.mark.skipif(library().lib is None, reason=library().why_not)
TOLERANCE = 2e-5  # float32 against float64, values of unit scale


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, d] over keys/values [Hkv, L, d], in float64: [Hkv, Hq/Hkv, d]."""
    grouped = q.double().view(keys.shape[0], -1, q.shape[-1])
    scores = grouped @ keys.double().transpose(1, 2) * scale
    return (scores.softmax(-1) @ values.double()).float()


@pytest.mark.parametrize("d", [8, 12, 16, 64, 96, 128])
@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 7, 9, 100, 1000])
def test_one_query_matches_softmax_attention(d, hq, hkv, length):
    gen = torch.Generator().manual_seed(d * 1000 + hq * 10 + length)
    q = torch.randn(hq, d, generator=gen)
    # Views of a larger cache, as a request's cache hands them in: heads `capacity` positions apart.
    keys = torch.randn(hkv, length + 5, d, generator=gen)[:, :length]
    values = torch.randn(hkv, length + 5, d, generator=gen)[:, :length]
    assert serves(q, keys, values)
    got = attend_one(q, keys, values, d**-0.5)
    assert (got - _reference(q, keys, values, d**-0.5)).abs().max().item() < TOLERANCE


def test_a_dominant_key_takes_all_the_weight_and_far_scores_underflow_to_zero():
    d = 64
    keys = torch.zeros(1, 5, d)
    keys[0, 3] = 100.0  # its score is 100 * sum(q) / 8 above the others
    values = torch.arange(5.0).view(1, 5, 1).expand(1, 5, d).contiguous()
    out = attend_one(torch.ones(1, d), keys, values, d**-0.5)
    assert torch.equal(out, torch.full((1, 1, d), 3.0))


def _rows_case(seed: int, rows: int, hq: int, hkv: int, d: int):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    size = rows * 120
    store_k, store_v = torch.randn(hkv, size, d, generator=gen), torch.randn(hkv, size, d, generator=gen)
    order = rng.sample(range(size), size)  # rows own disjoint positions, scattered as block tables are
    positions = [order[i * 120 : i * 120 + rng.randint(1, 120)] for i in range(rows)]
    stacked = torch.randn(rows + 2, hq + 2 * hkv, d, generator=gen)  # a step's fused q/k/v, two rows more
    q, k, v = stacked[:, :hq], stacked[:, hq : hq + hkv], stacked[:, hq + hkv :]
    at = sorted(rng.sample(range(rows + 2), rows))  # each row's place among the step's tokens
    return store_k, store_v, positions, q, k, v, at


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 16), (6, 1, 12)])
def test_rows_write_their_slots_and_equal_each_row_alone(hq, hkv, d):
    rows = 5
    store_k, store_v, positions, q, k, v, at = _rows_case(7, rows, hq, hkv, d)
    slots = [p[-1] for p in positions]
    want_k, want_v = store_k.clone(), store_v.clone()
    for i, t in enumerate(at):
        want_k[:, slots[i]], want_v[:, slots[i]] = k[t], v[t]
    out = RowsKernel(positions, slots, at, at, d**-0.5, threads=2)(q, k, v, store_k, store_v)
    assert torch.equal(store_k, want_k) and torch.equal(store_v, want_v)
    for i in range(rows):
        p = torch.tensor(positions[i])
        row_k, row_v = want_k[:, p].contiguous(), want_v[:, p].contiguous()
        reference = _reference(q[at[i]], row_k, row_v, d**-0.5).reshape(-1)
        assert (out[i] - reference).abs().max().item() < TOLERANCE
        assert torch.equal(out[i], attend_one(q[at[i]], row_k, row_v, d**-0.5).reshape(-1))


def test_rows_are_the_same_bits_on_one_thread_or_two():
    hq, hkv, d = 9, 3, 64
    results = []
    for threads in (1, 2):
        store_k, store_v, positions, q, k, v, at = _rows_case(3, 8, hq, hkv, d)
        kernel = RowsKernel(positions, [p[-1] for p in positions], at, at, d**-0.5, threads)
        results.append(kernel(q, k, v, store_k, store_v))
    assert torch.equal(*results)


def test_the_eager_step_kernel_writes_the_slot_and_attends_as_one_query_does():
    hq, hkv, d, capacity, pos = 9, 3, 64, 40, 17
    gen = torch.Generator().manual_seed(5)
    keys = [torch.randn(hkv, capacity, d, generator=gen) for _ in range(2)]
    values = [torch.randn(hkv, capacity, d, generator=gen) for _ in range(2)]
    q, k, v = torch.randn(hkv, hq // hkv, d, generator=gen), torch.randn(hkv, d, generator=gen), torch.randn(hkv, d)
    out = torch.empty(hkv, hq // hkv, d)
    assert SlotKernel.serves(q, k, v, out, keys[0])
    kernel = SlotKernel(keys, values, pos, (q, k, v, out), d**-0.5)
    before = keys[0].clone()
    kernel(1)  # layer 1 only
    assert torch.equal(keys[0], before)
    assert torch.equal(keys[1][:, pos], k) and torch.equal(values[1][:, pos], v)
    expected = attend_one(q, keys[1][:, : pos + 1], values[1][:, : pos + 1], d**-0.5)
    assert torch.equal(out, expected)


def _rows_per_position(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """A prompt chunk's queries q [1, Hq, T, d] at positions start.. over keys/values [1, Hkv, start+T, d],
    causal, through the decode kernel with each query position a row of its own: [1, Hq, T, d]. A row's
    output depends only on its query and the keys and values up to it, so it is the same bits however
    the prompt was cut."""
    _, hq, length, d = q.shape
    hkv = keys.shape[1]
    rows = q[0].transpose(0, 1).contiguous()  # [T, Hq, d]
    out = torch.empty(length, hq * d, dtype=torch.float32)
    # row i sees positions 0 .. start + i: lengths start + 1 .., and `ends` their running sums
    ends = torch.arange(start + 1, start + length + 1, dtype=torch.long).cumsum(0)
    k, v = keys[0], values[0]
    args = AttendArgs(
        rows=length, hq=hq, hkv=hkv, d=d, scale=scale, threads=torch.get_num_threads(),
        q=rows.data_ptr(), q_rs=hq * d, kc=k.data_ptr(), vc=v.data_ptr(), kc_hs=k.stride(0), vc_hs=v.stride(0),
        ends=ends.data_ptr(), out=out.data_ptr(), out_rs=hq * d,
    )  # fmt: skip
    library().lib.attend_rows(ctypes.addressof(args))
    return out.view(length, hq, d).transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize(("length", "start"), [(40, 0), (16, 24), (1, 39), (9, 100)])
def test_a_prompts_rows_attend_as_softmax_does_and_alike_however_the_prompt_is_chunked(length, start):
    gen = torch.Generator().manual_seed(3)
    total = start + length
    k, v = torch.randn(1, 3, total, 64, generator=gen), torch.randn(1, 3, total, 64, generator=gen)
    q = torch.randn(1, 9, total, 64, generator=gen)
    whole = _rows_per_position(q, k, v, 0, 0.125)
    part = _rows_per_position(q[:, :, start:].contiguous(), k, v, start, 0.125)
    assert torch.equal(part, whole[:, :, start:])
    scores = torch.einsum("hqd,hkd->hqk", q[0].double(), k[0].double().repeat_interleave(3, 0)) * 0.125
    scores.masked_fill_(torch.ones(total, total).triu(1).bool(), float("-inf"))
    ref = torch.einsum("hqk,hkd->hqd", scores.softmax(-1), v[0].double().repeat_interleave(3, 0))
    assert (whole[0].double() - ref).abs().max() < 1e-5
