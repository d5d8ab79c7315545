"""The C row operations (`row_ops.CNorm`, `c_rotate`, `c_silu_mul`) and the C stack of a one-token
step (`eager_step.LayerStack`).

References: float64 for RMSNorm and SiLU-gating (the C norm sums in another order than torch:
within 1e-6 relative), torch's own `rotate` bit for bit for the rotation, and the Python block
bit for bit for the stack: the stack calls the same kernels on the same buffers, so a request's
logits must not depend on which of the two ran its step, nor on the rows sharing a batched step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minengine.config import ModelConfig
from minengine.fast.cpu_kernels import library
from minengine.fast.eager_step import LayerStack
from minengine.fast.panel_kernels import ACTIVATIONS_ENV
from minengine.fast.row_ops import CNorm, c_norm, c_rotate, c_silu_mul
from minengine.kv.cache import KVCache
from minengine.model.ops import RMSNorm, rotate
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row

CPU = torch.device("cpu")
PROMPT_LEN, STEPS = 20, 6

needs_kernel = pytest.mark.skipif(library().lib is None, reason=library().why_not)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())


# -- the row operations ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("d", [576, 64, 61, 8, 3])
def test_rms_norm_rows_are_float64s_and_each_row_its_own(d):
    weight, eps = _randn(d, seed=1), 1e-5
    norm = CNorm(weight, eps)
    x = _randn(9, d) * 3
    y = norm(x)
    ref = weight.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps))
    assert _rel(y, ref) < 1e-6
    assert torch.equal(torch.cat([norm(x[i : i + 1]) for i in range(9)]), y)  # alone or beside others
    heads = _randn(3, 5, 2 * d)[:, :, :d]  # rows inside wider rows: strided heads
    assert torch.equal(norm(heads), norm(heads.contiguous()))


@needs_kernel
def test_a_weight_per_head_keeps_torchs_norm():
    weight = _randn(4, 16)  # qwen3's q/k norms: one weight row per head
    assert isinstance(c_norm(weight, 1e-6), RMSNorm) and isinstance(c_norm(weight[0], 1e-6), CNorm)


@needs_kernel
def test_rotate_in_c_is_torchs_rotate_bit_for_bit():
    table_cos, table_sin = _randn(50, 64, seed=2), _randn(50, 64, seed=3)
    cos, sin = table_cos[7:12, None], table_sin[7:12, None]  # lookup_signed's views
    qkv = _randn(5, 15 * 64, seed=4)
    qk = qkv[:, : 12 * 64].view(5, 12, 64)  # q and k heads inside the fused output
    want = qk * cos + qk.roll(32, dims=-1) * sin  # rope.rotate's torch operations
    assert torch.equal(c_rotate(qk, cos, sin, None), want)
    out = torch.empty(5, 12, 64)
    assert rotate(qk, cos, sin, out=out, scratch=torch.empty(5, 12, 64)) is out and torch.equal(out, want)


@needs_kernel
@pytest.mark.parametrize("n", [1536, 13, 8, 1])
def test_silu_gating_is_float64s_in_place_or_not(n):
    gate = torch.cat([_randn(4, n) * 10, torch.full((1, n), -100.0)])  # a row far below zero: no overflow
    up = _randn(5, n, seed=5)
    ref = F.silu(gate.double()) * up.double()
    y = c_silu_mul(gate, up)
    assert torch.isfinite(y).all() and _rel(y[:4], ref[:4]) < 1e-6 and y[4].abs().max() < 1e-30
    assert torch.equal(torch.cat([c_silu_mul(gate[i : i + 1], up[i : i + 1]) for i in range(5)]), y)
    inplace = gate.clone()
    assert c_silu_mul(inplace, up, out=inplace) is inplace and torch.equal(inplace, y)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_a_prompts_rows_shared_among_threads_keep_each_rows_bits(threads):
    # From 256 rows (row_ops.c's SHARED_ROWS) the rows go to the threads in runs, whichever thread
    # is free next: a row's result must not depend on which took it, nor on the rows beside it.
    rows, before = 301, torch.get_num_threads()
    x, weight = _randn(rows, 576) * 3, _randn(576, seed=1)
    qk = _randn(rows, 12, 64, seed=2)
    cos, sin = _randn(rows, 1, 64, seed=3), _randn(rows, 1, 64, seed=4)
    gate, up = _randn(rows, 1536, seed=5) * 8, _randn(rows, 1536, seed=6)
    norm = CNorm(weight, 1e-5)
    try:
        torch.set_num_threads(1)
        alone = [
            torch.cat([norm(x[i : i + 1]) for i in range(rows)]),
            torch.cat([c_rotate(qk[i : i + 1], cos[i : i + 1], sin[i : i + 1]) for i in range(rows)]),
            torch.cat([c_silu_mul(gate[i : i + 1], up[i : i + 1]) for i in range(rows)]),
        ]
        torch.set_num_threads(threads)
        shared = [norm(x), c_rotate(qk, cos, sin), c_silu_mul(gate, up)]
    finally:
        torch.set_num_threads(before)
    for one, together in zip(alone, shared, strict=True):
        assert torch.equal(one.view(torch.int32), together.view(torch.int32))


@needs_kernel
def test_silu_gating_gives_a_value_the_same_bits_in_16_lanes_as_in_8():
    # A row of 1,536 goes through the 16 lanes where the build has AVX-512; rows of 8 values only
    # through the 8 (exp_le0.h's two widths of one arithmetic). Edge values included: zeros of
    # both signs, denormals, values past the exponential's cut at -87 and infinities.
    edges = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 86.9, -86.9, 88.0, -88.0, 1e4, -1e4, float("inf"), -float("inf")])
    gate = torch.cat([_randn(1, 1536 - edges.numel())[0] * 8, edges]).view(1, -1)
    up = _randn(1, 1536, seed=7)
    whole = c_silu_mul(gate, up)
    by_eight = c_silu_mul(gate.view(-1, 8), up.view(-1, 8)).view(1, -1)
    assert torch.equal(whole.view(torch.int32), by_eight.view(torch.int32))


@needs_kernel
def test_a_prompts_rows_shared_among_threads_are_each_rows_own_bits():
    """From 256 rows a call shares its rows out among torch's threads (a prompt's norms, rotations and
    gating); each row is still computed alone: the same bits as one row at a time, on one thread."""
    rows = 300
    weight, x = _randn(576, seed=6), _randn(rows, 576, seed=7) * 3
    norm = CNorm(weight, 1e-5)
    cos, sin = _randn(rows, 1, 64, seed=8), _randn(rows, 1, 64, seed=9)
    qk = _randn(rows, 12, 64, seed=10)
    gate, up = _randn(rows, 1536, seed=11) * 10, _randn(rows, 1536, seed=12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        shared = norm(x), c_rotate(qk, cos, sin, None), c_silu_mul(gate, up)
        torch.set_num_threads(1)
        alone = (torch.cat([norm(x[i : i + 1]) for i in range(rows)]),
                 torch.cat([c_rotate(qk[i : i + 1], cos[i : i + 1], sin[i : i + 1], None) for i in range(rows)]),
                 torch.cat([c_silu_mul(gate[i : i + 1], up[i : i + 1]) for i in range(rows)]))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for ours, theirs in zip(shared, alone, strict=True):
        assert torch.equal(ours, theirs)


# -- the stack ------------------------------------------------------------------------------------


needs_vnni = pytest.mark.skipif(
    library().lib is None or not library().lib.dot8_native(), reason="rounded activations need AVX-512 VNNI"
)
# The block formats under each activations: float32 rows, and rows rounded to int16 (the default on a VNNI CPU) or int8.
BLOCKS = ["q8_0+float32", "q4_1+float32"]
ROUNDED = [pytest.param(f"{fmt}+{acts}", marks=needs_vnni) for acts in ("int16", "int8") for fmt in ("q8_0", "q4_1")]


def _runner(folder, packs, monkeypatch=None):
    """The model under `packs`; "FORMAT+ACTS" loads FORMAT with those activations (float32, int16, int8)."""
    packs, _, acts = (packs or "").partition("+")
    packs = packs or None
    if acts:
        monkeypatch.setenv(ACTIVATIONS_ENV, acts)
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs))


def _cache(cfg):
    return KVCache(cfg, PROMPT_LEN + STEPS + 1, device=CPU, compute_dtype=torch.float32)


def _steps(runner, cfg, monkeypatch, stack: bool) -> list[torch.Tensor]:
    """STEPS steps of fixed tokens through the lean step, with the C stack or the Python blocks."""
    assert LayerStack.of(runner.model) is not None
    with monkeypatch.context() as patch:
        if not stack:
            patch.setattr(runner, "_stack", None)  # the plan then runs the Python blocks
        cache = _cache(cfg)
        runner.forward(_randn(PROMPT_LEN).abs().mul(100).long() % cfg.vocab_size, 0, cache)
        return [runner.forward(torch.tensor([3 + i]), PROMPT_LEN + i, cache) for i in range(STEPS)]


@needs_kernel
@pytest.mark.parametrize("packs", ["float32-panels", "fp16-panels", *BLOCKS, *ROUNDED])
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "mistral"])
def test_the_c_stack_gives_the_python_blocks_logits_bit_for_bit(tiny_models, monkeypatch, packs, name):
    cfg, runner = _runner(tiny_models[name][0], packs, monkeypatch)
    assert LayerStack.serves(runner.model)
    # Over a DOT8 copy the stack runs the final norm and the head too; else the caller runs them.
    assert (LayerStack.of(runner.model).head is not None) == packs.endswith(("+int16", "+int8"))
    ours, python = _steps(runner, cfg, monkeypatch, True), _steps(runner, cfg, monkeypatch, False)
    for a, b in zip(ours, python, strict=True):
        assert torch.equal(a, b)


def _pooled_steps(runner, cfg, pool, monkeypatch, stack: bool) -> list[list[torch.Tensor]]:
    """STEPS shared steps of 3 decode rows in the block pool (prompts of different lengths)."""
    with monkeypatch.context() as patch:
        if not stack:
            patch.setattr(runner, "_stack", None)  # the plan then runs the Python blocks
        caches, starts = [], []
        for i, n in enumerate((PROMPT_LEN, PROMPT_LEN + 5, PROMPT_LEN + 11)):
            cache = runner.new_cache(n + STEPS + 1, pool=pool, owner=f"r{i}")
            runner.forward(_randn(n, seed=i).abs().mul(100).long() % cfg.vocab_size, 0, cache)
            caches.append(cache)
            starts.append(n)
        out = []
        for step in range(STEPS):
            pairs = enumerate(zip(caches, starts, strict=True))
            rows = [Row((3 + step + i,), start + step, c, True) for i, (c, start) in pairs]
            out.append(runner.forward_rows(rows))
        for cache in caches:
            cache.release()
        return out


@needs_kernel
@pytest.mark.parametrize("packs", ["float32-panels", "fp16-panels", *BLOCKS, *ROUNDED])
def test_a_shared_steps_decode_rows_in_the_c_stack_are_the_python_blocks_bit_for_bit(tiny_models, monkeypatch, packs):
    from minengine.kv.block_pool import BlockPool

    cfg, runner = _runner(tiny_models["llama-gqa"][0], packs, monkeypatch)
    pool = BlockPool(64 << 20, CPU)
    ours = _pooled_steps(runner, cfg, pool, monkeypatch, True)
    python = _pooled_steps(runner, cfg, pool, monkeypatch, False)
    for a, b in zip(ours, python, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@needs_kernel
@pytest.mark.parametrize("packs", ["float32-panels", "fp16-panels", *ROUNDED])
def test_a_row_alone_in_the_c_stack_is_that_row_in_a_batched_step(tiny_models, monkeypatch, packs):  # the Python blocks
    cfg, runner = _runner(tiny_models["llama-gqa"][0], packs, monkeypatch)
    ids = _randn(PROMPT_LEN).abs().mul(100).long() % cfg.vocab_size
    alone, others = _cache(cfg), [_cache(cfg) for _ in range(3)]
    for cache in (alone, *others):
        runner.forward(ids, 0, cache)
    want = runner.forward(torch.tensor([7]), PROMPT_LEN, alone)  # the lean step, through the C stack
    for got in runner.forward_rows([Row((7,), PROMPT_LEN, c, True) for c in others]):
        assert torch.equal(got, want)


@needs_kernel
def test_the_stack_serves_llama_shaped_blocks_in_panels_only(tiny_models):
    folder = tiny_models["llama-gqa"][0]
    assert not LayerStack.serves(_runner(folder, None)[1].model)  # dense operands
    for name in ("qwen2", "qwen3"):  # q/k/v bias; per-head q/k norms
        assert not LayerStack.serves(_runner(tiny_models[name][0], "fp16-panels")[1].model)


@needs_kernel
@pytest.mark.parametrize("packs", ROUNDED)
def test_a_prompt_through_the_python_blocks_is_the_same_bits_gated_in_the_product_or_after_it(
    tiny_models, monkeypatch, packs
):
    """Over a DOT8 copy each layer's gate/up product gates its own sums (`Layer.gated`, bound at load), and a
    path through the Python blocks says so; the logits of every position are those of the product, then the C
    gating over its two chunks."""
    cfg, runner = _runner(tiny_models["llama-gqa"][0], packs, monkeypatch)
    layers, ops = runner.model.layers, runner.model.ops
    assert all(layer.gating_in_product for layer in layers)
    ids = _randn(200, seed=4).abs().mul(100).long() % cfg.vocab_size

    def logits() -> torch.Tensor:
        return runner.model.forward(ids, 0, KVCache(cfg, 256, device=CPU, compute_dtype=torch.float32), all_logits=True)

    assert "gating in the gate/up product" in runner.pick(ids, 0, _cache(cfg)).path.why
    gated = logits()
    for layer in layers:
        monkeypatch.setattr(layer, "gated", lambda h, layer=layer: ops.silu_mul(*layer.gate_up_proj.chunks(h)))
    assert torch.equal(gated, logits())
