"""The paged KV cache: the same K/V and logits as a request-owned `KVCache` in every family and
storage, the lean step over consecutive blocks, the seeds' byte formula, sharing without
copies, copy on write, exhaustion, and every block back in the pool."""

from __future__ import annotations

import pytest
import torch
from tiny_models import SPECS

from minengine.config import ModelConfig
from minengine.kv.arithmetic import blocks_for, kv_bytes, stored_kv_heads
from minengine.kv.block_pool import BlockPool, PoolExhausted
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.prefix_cache import KVIdentity, PrefixCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")
PROMPT, STEPS, BLOCK = 21, 8, 4
STORAGES = {
    "gqa": {},
    "mha": {"layout": "mha"},
    "bf16": {"storage_dtype": torch.bfloat16},
    "fp8": {"storage_dtype": torch.float8_e4m3fn},
}


def _runner(folder) -> ModelRunner:
    cfg = ModelConfig.from_file(folder)
    return ModelRunner(load_model(folder, cfg, torch.float32, CPU))


def _paged(pool: BlockPool, cfg, owner: str = "a", expect: int = PROMPT + STEPS, **options) -> PagedKVCache:
    return PagedKVCache(
        pool, cfg, owner=owner, device=CPU, compute_dtype=torch.float32, block_size=BLOCK, expect_tokens=expect,
        **options,
    )  # fmt: skip


def _split(pool: BlockPool, cfg, **options) -> tuple[PagedKVCache, PagedKVCache]:
    """A cache whose blocks alternate with a neighbour's: every read gathers its runs."""
    cache, neighbour = _paged(pool, cfg, "a", 0, **options), _paged(pool, cfg, "n", 0, **options)
    for end in range(BLOCK, PROMPT + STEPS + BLOCK, BLOCK):
        cache.make_room(end)
        neighbour.make_room(end)
    assert not cache.contiguous
    return cache, neighbour


def _decode(forward, cache, cfg) -> list[torch.Tensor]:
    ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    out = [forward(ids, 0, cache)]
    for step in range(STEPS):
        out.append(forward(out[-1].argmax().view(1), PROMPT + step, cache))
    return out


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_paged_kv_and_logits_equal_the_request_owned_cache(tiny_models, name, storage):
    runner = _runner(tiny_models[name][0])
    cfg, model, options = runner.model.cfg, runner.model, STORAGES[storage]
    owned = KVCache(cfg, PROMPT + STEPS, device=CPU, compute_dtype=torch.float32, block_size=BLOCK, **options)
    expected = _decode(model.forward, owned, cfg)
    pool = BlockPool(4 << 20, CPU)
    consecutive = _paged(pool, cfg, **options)
    split, neighbour = _split(pool, cfg, **options)
    for cache in (consecutive, split):
        got = _decode(model.forward, cache, cfg)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (storage, cache.contiguous)
        end = PROMPT + STEPS  # the prompt and every token fed back
        for layer in (0, cfg.num_hidden_layers - 1):
            probe = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
            k, v = cache.update(layer, probe, probe, end)
            k_ref, v_ref = owned.update(layer, probe, probe, end)
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert consecutive.contiguous
    for cache in (consecutive, split, neighbour):
        cache.release()
    assert pool.held_bytes == 0 and pool.holders() == {}


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_the_lean_step_serves_consecutive_blocks_bit_for_bit(tiny_models, name):
    runner = _runner(tiny_models[name][0])
    cfg = runner.model.cfg
    pool = BlockPool(4 << 20, CPU)
    general = _decode(runner.model.forward, _paged(pool, cfg, "g"), cfg)
    lean_cache = _paged(pool, cfg, "l")
    served = []
    serves = runner.eager_decoder.serves
    runner.eager_decoder.serves = lambda cache, pos: served.append(serves(cache, pos)) or served[-1]
    lean = _decode(runner.forward, lean_cache, cfg)
    assert served == [True] * STEPS
    assert all(torch.equal(a, b) for a, b in zip(general, lean, strict=True))
    split, _ = _split(pool, cfg)
    served.clear()
    _decode(runner.forward, split, cfg)
    assert served == [False] * STEPS  # gathered runs take the general path


@pytest.mark.parametrize("storage", list(STORAGES))
def test_usage_is_the_seeds_formula_and_the_blocks_really_held(tiny_models, storage):
    runner = _runner(tiny_models["llama-gqa"][0])
    cfg, options = runner.model.cfg, STORAGES[storage]
    pool = BlockPool(4 << 20, CPU)
    cache = _paged(pool, cfg, **options)
    owned = KVCache(cfg, PROMPT + STEPS, device=CPU, compute_dtype=torch.float32, block_size=BLOCK, **options)
    _decode(runner.forward, cache, cfg)
    _decode(runner.forward, owned, cfg)
    usage, reference = cache.usage(), owned.usage()
    tokens = PROMPT + STEPS
    heads = stored_kv_heads(options.get("layout", "gqa"), cfg.num_attention_heads, cfg.num_key_value_heads)
    elem = options.get("storage_dtype", torch.float32).itemsize
    assert usage.tokens == tokens and usage.stored_heads == heads
    assert usage.logical_bytes == kv_bytes(cfg.num_hidden_layers, heads, cfg.head_dim, elem, tokens)
    assert usage.blocks == len(cache.blocks) == blocks_for(tokens, BLOCK)
    assert usage.physical_bytes == len(cache.blocks) * cache.format.nbytes == pool.held_bytes_by("a")
    for field in ("logical_bytes", "physical_bytes", "bytes_per_token", "per_layer_logical_bytes", "blocks"):
        assert getattr(usage, field) == getattr(reference, field), field
    freed = cache.release()
    assert freed.blocks == blocks_for(tokens, BLOCK) and freed.nbytes == usage.physical_bytes
    assert pool.held_bytes == 0


def test_blocks_are_allocated_when_a_position_first_needs_one(tiny_models):
    cfg = ModelConfig.from_file(tiny_models["llama-gqa"][0])
    pool = BlockPool(4 << 20, CPU)
    cache = _paged(pool, cfg)
    assert cache.blocks == [] and cache.blocks_needed(9) == 3
    cache.make_room(5)
    assert len(cache.blocks) == 2 and cache.capacity == 8 and cache.blocks_needed(9) == 1
    cache.make_room(8)
    assert len(cache.blocks) == 2
    cache.release()


def test_an_attached_prefix_is_shared_without_a_copy_and_never_written(tiny_models):
    runner = _runner(tiny_models["qwen2"][0])
    cfg = runner.model.cfg
    pool = BlockPool(4 << 20, CPU)
    ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(9))
    first = _paged(pool, cfg, "first")
    expected = runner.forward(ids, 0, first)
    shared = first.full_blocks()[:4]  # 16 positions: the prompt's last token is always computed
    seg = first.store.segment_of(shared[0])
    before = seg.k.clone(), seg.v.clone()
    second = _paged(pool, cfg, "second")
    second.attach_prefix(shared)
    assert second.blocks[:4] == shared and all(pool.refs(first.format, b) == 2 for b in shared)
    probe = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
    keys, values = second.update(0, probe, probe, 16)
    lo = (shared[0] - seg.first) * BLOCK
    assert keys.data_ptr() == seg.k[0, 0, lo].data_ptr() and values.data_ptr() == seg.v[0, 0, lo].data_ptr()
    got = runner.forward(ids[16:], 16, second)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    hi = (shared[-1] + 1 - seg.first) * BLOCK
    assert torch.equal(seg.k[:, :, lo:hi], before[0][:, :, lo:hi])  # positions 0-15 as the first request wrote them
    assert torch.equal(seg.v[:, :, lo:hi], before[1][:, :, lo:hi])
    assert second.sharing().with_requests == 4 and second.sharing().own == len(second.blocks) - 4
    held = len(first.blocks)
    assert first.release().blocks == held - 4  # the shared ones stay, second holds them
    assert second.sharing().own == len(second.blocks)  # first let go: they are second's alone now
    second.release()
    assert pool.held_bytes == 0


def test_a_write_into_a_shared_block_copies_it_first(tiny_models):
    runner = _runner(tiny_models["llama-gqa"][0])
    cfg = runner.model.cfg
    pool = BlockPool(4 << 20, CPU)
    ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(4))
    first = _paged(pool, cfg, "first")
    expected = runner.forward(ids, 0, first)
    shared = first.full_blocks()[:4]
    seg = first.store.segment_of(shared[0])
    before = seg.k.clone()
    second = _paged(pool, cfg, "second")
    second.attach_prefix(shared)
    got = runner.forward(ids[14:], 14, second)  # rewrites positions 14 and 15, inside the fourth shared block
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    assert second.blocks[:3] == shared[:3] and second.blocks[3] != shared[3]
    assert pool.refs(first.format, shared[3]) == 1 and pool.refs(first.format, shared[0]) == 2
    lo, hi = (shared[0] - seg.first) * BLOCK, (shared[-1] + 1 - seg.first) * BLOCK
    assert torch.equal(seg.k[:, :, lo:hi], before[:, :, lo:hi])  # the shared blocks are as first wrote them
    first.release()
    second.release()
    assert pool.held_bytes == 0


def test_an_exhausted_pool_raises_and_still_takes_every_block_back(tiny_models):
    runner = _runner(tiny_models["llama-gqa"][0])
    cfg = runner.model.cfg
    probe = _paged(BlockPool(1 << 20, CPU), cfg)
    pool = BlockPool(6 * probe.format.nbytes, CPU)  # 24 positions
    cache = _paged(pool, cfg)
    ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1))
    logits = runner.forward(ids, 0, cache)
    with pytest.raises(PoolExhausted):
        for step in range(STEPS):
            logits = runner.forward(logits.argmax().view(1), PROMPT + step, cache)
    assert cache.valid_tokens == 24 and len(cache.blocks) == 6
    assert cache.release().blocks == 6 and pool.held_bytes == 0 and pool.free_bytes == pool.budget_bytes


def test_a_request_that_hits_a_kept_prefix_grows_right_after_it_in_one_run(tiny_models):
    runner = _runner(tiny_models["llama-gqa"][0])
    cfg = runner.model.cfg
    pool = BlockPool(4 << 20, CPU)
    prefix = PrefixCache(pool)
    identity = KVIdentity("tiny", "float32", "cpu", "gqa", "float32", BLOCK)
    first = _paged(pool, cfg, "first")
    expected = _decode(runner.forward, first, cfg)
    ids = torch.randint(3, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    fed = ids + [int(out.argmax()) for out in expected[:-1]]
    assert prefix.store(prefix.fresh_blocks(first, fed, identity), room=1 << 30) == len(fed) // BLOCK
    first.release()
    # The same prompt again: its first five blocks hit; the sixth, kept too (it holds the prompt's
    # last token and the first answer's start), is where this request's own K/V goes next.
    hit = prefix.lookup(ids, identity, holder="hit")
    second = _paged(pool, cfg, "second")
    second.attach_prefix(list(hit.block_ids))
    hit.release()
    got = _decode_from(runner, second, ids, hit.tokens)
    assert second.contiguous and second.blocks[: hit.blocks] == list(hit.block_ids)
    assert all(pool.refs(second.format, b) == 2 for b in hit.block_ids)  # shared, never copied
    assert prefix.evicted_blocks >= 1  # the kept block it grew into
    assert [int(a.argmax()) for a in got] == [int(a.argmax()) for a in expected]
    assert torch.allclose(got[0], expected[0], atol=1e-5, rtol=0)
    second.release()
    prefix.clear()
    assert pool.held_bytes == 0


def _decode_from(runner: ModelRunner, cache: PagedKVCache, ids: list[int], reused: int) -> list[torch.Tensor]:
    out = [runner.forward(torch.tensor(ids[reused:]), reused, cache)]
    for step in range(STEPS):
        out.append(runner.forward(out[-1].argmax().view(1), len(ids) + step, cache))
    return out
