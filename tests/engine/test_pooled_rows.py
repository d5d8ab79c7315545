"""Decode rows attended together over the block pool (`PooledRows`) against each row on its own.

Each case builds the same caches twice and runs one shared step both ways, with the C kernel
(`attention_rows`) and with torch's path that stands in where it cannot be built. Through the
kernel the logits are the same bits (each row's arithmetic is its own either way); through torch
they agree within float32 rounding (SDPA sums a row in another order than the per-row
operations), and the K/V written are the same bytes. The cases cover several context lengths in
one step, GQA, MHA and MQA, a table split over runs, tables in several segments, and decode rows
beside a prompt chunk.
"""

from __future__ import annotations

import pytest
import torch

import minengine.fast.attention_rows as attention_rows
import minengine.steps.shared_step as batch_forward
from minengine.config import ModelConfig
from minengine.fast.cpu_kernels import KernelLibrary, library
from minengine.fast.pooled_rows import pooled_count
from minengine.kv.block_pool import BlockFormat, BlockPool, Segment
from minengine.kv.paged_cache import PagedKVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row
from minengine.steps.rows_attention import RowsAttention
from minengine.steps.shared_step import forward_rows

CPU = torch.device("cpu")
BLOCK = 4
TOLERANCE = 2e-5  # float32 logits, absolute: the two paths differ only in summation order
CONTEXTS = (3, 9, 17, 41)  # each row's prompt: mixed lengths, a block boundary either side


@pytest.fixture(params=["kernel", "torch"], autouse=True)
def kernel(request, monkeypatch) -> bool:
    """Every case twice: through the C kernel (where it builds here) and through torch's path."""
    if request.param == "kernel":
        if library().lib is None:
            pytest.skip(library().why_not)
        return True
    monkeypatch.setattr(attention_rows, "library", lambda: KernelLibrary(None, "switched off by the test"))
    return False


def _runner(folder) -> tuple[ModelConfig, ModelRunner]:
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, torch.float32, CPU), static_decode=False)


def _prompt(cfg: ModelConfig, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _caches(runner: ModelRunner, cfg: ModelConfig, contexts, *, split: bool = False, segment_blocks: int = 0):
    """Prefilled paged caches, one per context, in one pool; their first decode tokens.

    `split` interleaves the caches' blocks (every table several runs); `segment_blocks` makes the
    pool's segments that small (tables cross segments)."""
    fmt = BlockFormat(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK, torch.float32)
    first = segment_blocks * fmt.nbytes if segment_blocks else 1 << 30
    pool = BlockPool(256 << 20, CPU, first_segment_bytes=first)
    caches = [
        PagedKVCache(pool, cfg, owner=f"r{i}", device=CPU, compute_dtype=torch.float32, block_size=BLOCK,
                     expect_tokens=0 if split else n + 8)
        for i, n in enumerate(contexts)
    ]  # fmt: skip
    if split:
        for end in range(BLOCK, max(contexts) + 2 * BLOCK, BLOCK):
            for cache, n in zip(caches, contexts, strict=True):
                if end <= n + BLOCK:
                    cache.make_room(end)
    tokens = []
    for i, (cache, n) in enumerate(zip(caches, contexts, strict=True)):
        logits = runner.forward(_prompt(cfg, n, seed=i), 0, cache)
        tokens.append(int(logits.argmax()))
    return caches, tokens


def _step(runner, caches, tokens, contexts, monkeypatch, pooled: bool, chunk=None):
    """One shared step of every cache's next token (and `chunk`, a prompt chunk row), pooled or per
    row; the logits, and how many rows went together."""
    count = (lambda _, lengths: len(lengths)) if pooled else (lambda *_: 0)
    monkeypatch.setattr(batch_forward, "pooled_rows_count", count)
    rows = [Row((t,), n, c, True) for c, t, n in zip(caches, tokens, contexts, strict=True)]
    if chunk is not None:
        rows.insert(1, chunk)
    for row in rows:
        row.cache.make_room(row.start + len(row.ids))
    model = runner.model
    attention = RowsAttention(rows, model, batch_forward.pool_groups(rows, model))
    return forward_rows(model, rows), sum(len(chosen) for _, chosen in attention.pooled)


def _read(cache: PagedKVCache, end: int) -> list[torch.Tensor]:
    """Every layer's K and V for [0, end), gathered from the table's runs."""
    out = []
    for layer in range(cache.cfg.num_hidden_layers):
        for which in ("k", "v"):
            parts = [getattr(r.segment, which)[layer].narrow(1, r.local, r.tokens) for r in cache.runs(end)]
            out.append(torch.cat(parts, dim=1))
    return out


def _compare(runner, cfg, contexts, monkeypatch, kernel: bool, **layout):
    """Both paths on the same caches; the pooled step's caches, and how many rows it pooled."""
    together_caches, tokens = _caches(runner, cfg, contexts, **layout)
    alone_caches, same = _caches(runner, cfg, contexts, **layout)
    assert tokens == same
    together, pooled = _step(runner, together_caches, tokens, contexts, monkeypatch, pooled=True)
    alone, none = _step(runner, alone_caches, tokens, contexts, monkeypatch, pooled=False)
    assert none == 0
    for a, b in zip(together, alone, strict=True):
        assert torch.equal(a, b) if kernel else (a - b).abs().max().item() <= TOLERANCE
    for c1, c2, n in zip(together_caches, alone_caches, contexts, strict=True):
        assert c1.lengths == c2.lengths == [n + 1] * cfg.num_hidden_layers
        for layer, (x, y) in enumerate(zip(_read(c1, n + 1), _read(c2, n + 1), strict=True)):
            assert torch.equal(x[:, :n], y[:, :n])  # the prompt's K/V, from the same prefill
            # The new position's: the same bytes in the first layer, whose input is the same;
            # after it, the inputs differ by the attention's rounding.
            if layer < 2:
                assert torch.equal(x[:, n], y[:, n])
            assert (x[:, n] - y[:, n]).abs().max().item() <= TOLERANCE
    return together_caches, pooled


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "llama-mqa"])
def test_rows_attended_together_equal_each_row_alone(tiny_models, name, monkeypatch, kernel):
    cfg, runner = _runner(tiny_models[name][0])
    caches, pooled = _compare(runner, cfg, CONTEXTS, monkeypatch, kernel)
    assert all(c.contiguous for c in caches) and pooled == len(CONTEXTS)


@pytest.mark.parametrize("contexts", [(5, 5), (1, 2), (2, 30, 7), (12, 12, 12, 12, 12, 12, 12, 12)])
def test_equal_at_every_mix_of_lengths(tiny_models, contexts, monkeypatch, kernel):
    cfg, runner = _runner(tiny_models["llama-gqa"][0])
    _, pooled = _compare(runner, cfg, contexts, monkeypatch, kernel)
    assert pooled == len(contexts)


def test_split_tables_are_read_by_position(tiny_models, monkeypatch, kernel):
    cfg, runner = _runner(tiny_models["llama-gqa"][0])
    caches, pooled = _compare(runner, cfg, CONTEXTS, monkeypatch, kernel, split=True)
    assert not any(c.contiguous for c in caches[1:]) and pooled == len(CONTEXTS)


@pytest.mark.parametrize(("split", "segment_blocks"), [(False, 8), (True, 16)])
def test_rows_in_several_segments_go_a_group_per_segment(tiny_models, split, segment_blocks, monkeypatch, kernel):
    cfg, runner = _runner(tiny_models["llama-gqa"][0])
    contexts = CONTEXTS + CONTEXTS
    caches, pooled = _compare(runner, cfg, contexts, monkeypatch, kernel, split=split, segment_blocks=segment_blocks)
    segments = [{id(r.segment) for r in c.runs(c.tokens)} for c in caches]
    alone = [s.pop() for s in segments if len(s) == 1]  # a table across segments keeps the per-row path
    groups = [alone.count(seg) for seg in set(alone)]
    assert max(groups) > 1
    if split:  # some tables cross segments
        assert len(alone) < len(contexts)
    else:  # none does, and the rows lie in several segments
        assert len(alone) == len(contexts) and len(groups) > 1
    assert pooled == sum(n for n in groups if n > 1)


def test_decode_rows_beside_a_prompt_chunk(tiny_models, monkeypatch, kernel):
    cfg, runner = _runner(tiny_models["llama-gqa"][0])
    results = []
    for pooled in (True, False):
        caches, tokens = _caches(runner, cfg, CONTEXTS)
        fresh = caches[0].pool
        chunk_cache = PagedKVCache(fresh, cfg, owner="chunk", device=CPU, compute_dtype=torch.float32,
                                   block_size=BLOCK, expect_tokens=16)  # fmt: skip
        chunk = Row(tuple(_prompt(cfg, 6, seed=9).tolist()), 0, chunk_cache, True)
        logits, together = _step(runner, caches, tokens, CONTEXTS, monkeypatch, pooled, chunk=chunk)
        assert together == (len(CONTEXTS) if pooled else 0)
        results.append(logits)
    assert len(results[0]) == len(CONTEXTS) + 1
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b) if kernel else (a - b).abs().max().item() <= TOLERANCE


def test_the_rule_attends_short_rows_together_and_leaves_long_ones_alone(kernel):
    segment = Segment(BlockFormat(2, 1, 8, BLOCK, torch.float32), 0, 4, CPU)
    if kernel:  # the kernel gathers nothing: every row of a segment goes together, at any length
        assert batch_forward.pooled_rows_count(segment, [60]) == 1
        assert batch_forward.pooled_rows_count(segment, [60] * 7 + [2000]) == 8
        return
    assert batch_forward.pooled_rows_count(segment, [60] * 7 + [2000]) == 7
    assert pooled_count([60]) == 0  # one row: nothing to share
    assert pooled_count([60] * 8) == 8
    assert pooled_count([2000] * 8) == 0  # the gather would copy more than the per-row path reads
    mixed = pooled_count([60] * 7 + [2000])
    assert mixed == 7  # the long row keeps its own path; the short ones are not padded to it
    assert all(pooled_count(n) != 1 for n in ([60], [60, 5000], [10, 3000, 3000]))
