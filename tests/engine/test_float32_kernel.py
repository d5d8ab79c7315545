"""oneDNN's packed float32 kernel: the probe, packing, its products against `F.linear`, rows that
do not depend on the rows beside them, parity with transformers, and the dense fallback.

Tolerance: a packed product is the same float32 dot product summed in oneDNN's order, so it stays
within 1e-5 absolute (1e-6 relative to |x| |W|) of `F.linear` on weights of the default model's
scale; the tiny models' logits stay within transformers' 1e-4, as the dense operands' do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SPECS
from transformers_parity import assert_matches_transformers

from minengine.checkpoint import weight_format
from minengine.checkpoint.weight_format import FLOAT32_KERNEL_ENV, resolve_weights
from minengine.config import ModelConfig
from minengine.engine.engine import Engine
from minengine.fast import linear_kernels
from minengine.fast.cpu_kernels import library
from minengine.fast.linear_kernels import PACK_BATCH_HINT, KernelProbe, PackedLinear, available
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")
PROMPT_LEN, NEW_TOKENS = 20, 24
# The default model's projections (q/k/v fused, o, gate/up fused, down, the head) and odd shapes.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (17, 513), (200, 100)]

needs_onednn = pytest.mark.skipif(not available("float32").ok, reason=f"{available('float32').why_not}")


def _weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _x(rows: int, features: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))


# -- the kernel -----------------------------------------------------------------------------------


@needs_onednn
def test_the_probe_finds_the_kernel_and_says_so():
    probe = available("float32")
    assert probe == KernelProbe("float32", True)


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES)
def test_a_packed_product_is_f_linears_up_to_summation_order(shape):
    w = _weight(shape)
    packed = PackedLinear("float32", w, 1)
    assert packed.shape == (1, shape[1], shape[0])
    assert packed.stored_bytes == packed.read_bytes == shape[0] * shape[1] * 4  # float32's bytes, no padding
    for rows in (1, 2, 8, 38):
        x = _x(rows, shape[1])
        y = packed.linear(x)
        ref = F.linear(x, w)
        assert y.dtype == torch.float32 and y.shape == ref.shape
        bound = 1e-6 * (x.abs() @ w.abs().t()) + 1e-7
        assert ((y - ref).abs() <= bound).all(), float((y - ref).abs().max())


@needs_onednn
def test_chunks_keep_the_dense_operands_output_layout():
    """gate and up stay two chunks: `Product.chunks` hands back [chunks, T, out/chunks] as for a dense operand."""
    from minengine.checkpoint.weight_layout import product, projection_operand

    gate, up = _weight((64, 32), 1), _weight((64, 32), 2)
    packed = PackedLinear("float32", torch.cat([gate, up]), 2)
    dense = projection_operand(gate, up, chunks=2)
    x = _x(5, 32)
    ours, theirs = product(packed).chunks(x), product(dense).chunks(x)
    assert ours.shape == theirs.shape == (2, 5, 64)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    out = torch.empty(2, 1, 64)
    product(packed).chunks(x[:1], out=out)
    assert torch.equal(out, ours[:, :1])


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES[:5])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(shape):
    """Packed for PACK_BATCH_HINT rows, row i of any product is bit for bit its one-row product,
    for decode steps of 2..9 rows and prefills of 38 and 1,025, on one thread or two."""
    assert PACK_BATCH_HINT == 8
    if shape[1] > 1024 and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.xfail("oneDNN's AVX-512 GEMM sums a 1,536-input row in another order beside other rows (a Xeon)")
    packed = PackedLinear("float32", _weight(shape), 1)
    x = _x(1025, shape[1])
    alone = torch.cat([packed.linear(x[i : i + 1]) for i in range(9)])
    for rows in (2, 3, 5, 8, 9, 38, 1025):
        together = packed.linear(x[:rows])
        k = min(rows, 9)
        assert torch.equal(together[:k], alone[:k]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed.linear(x[:8]), alone[:8])
        assert torch.equal(packed.linear(x[:1]), alone[:1])
    finally:
        torch.set_num_threads(threads)


# -- choosing it ----------------------------------------------------------------------------------


def test_float32_takes_the_panel_kernel_unless_the_environment_asks_for_another(monkeypatch):
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "dense")
    assert resolve_weights("float32", CPU, torch.float32) == weight_format.WeightChoice("float32", "asked for", False)
    panels = library().lib is not None  # without a C compiler the default is dense, saying why
    # auto takes fp16 in the panel kernel where it runs, whatever float32's kernel; float32 where not.
    assert resolve_weights("auto", CPU, torch.float32).format == ("fp16" if panels else "float32")
    for asked in (None, "something else", "panels"):
        if asked is None:
            monkeypatch.delenv(FLOAT32_KERNEL_ENV, raising=False)
        else:
            monkeypatch.setenv(FLOAT32_KERNEL_ENV, asked)
        for name in ("float32",) if panels else ("float32", "auto"):
            choice = resolve_weights(name, CPU, torch.float32)
            assert choice.format == "float32" and choice.panels == choice.packed == panels
            assert choice.why.endswith(", through reqscope's panel kernel" if panels else library().why_not)


@needs_onednn
def test_the_environment_takes_onednns_kernel_and_the_reason_names_it(monkeypatch):
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "onednn")
    for name in ("float32",) if library().lib is not None else ("float32", "auto"):  # auto: fp16 where it runs
        choice = resolve_weights(name, CPU, torch.float32)
        assert (choice.format, choice.packed) == ("float32", True)
        assert choice.why.endswith(", through oneDNN's packed float32 kernel")
    # Elsewhere float32 is the dense compute dtype's own, whatever the environment says.
    assert not resolve_weights("float32", torch.device("cuda"), torch.float32).packed


def test_without_the_kernel_float32_falls_back_to_dense_and_says_why(monkeypatch, chatty_tiny_dir):
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "onednn")
    missing = KernelProbe("float32", False, "this torch build has no oneDNN")
    monkeypatch.setattr(weight_format, "available", lambda fmt: missing if fmt == "float32" else available(fmt))
    choice = resolve_weights("float32", CPU, torch.float32)
    assert (choice.format, choice.packed) == ("float32", False)
    assert choice.why == "asked for; dense, since this torch build has no oneDNN"
    engine = Engine(chatty_tiny_dir, device="cpu", weights="float32", kv_budget_bytes=64 << 20)
    assert not isinstance(engine.model.layers[0].o, PackedLinear)
    assert "weights float32 (asked for; dense, since this torch build has no oneDNN)" in engine.describe()


def test_a_failing_op_makes_the_probe_say_why(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such op here\nsecond line")

    monkeypatch.setattr(linear_kernels.torch.ops.mkldnn, "_reorder_linear_weight", broken, raising=False)
    probe = linear_kernels.available.__wrapped__("float32")  # past the per-process cache
    assert not probe.ok
    assert probe.why_not == "this torch build has no float32 linear kernel (no such op here)"


# -- in the model ---------------------------------------------------------------------------------


def _runner(folder, packs):
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs))


def _cache(cfg):
    return KVCache(cfg, PROMPT_LEN + NEW_TOKENS, device=CPU, compute_dtype=torch.float32)


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))


@needs_onednn
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_prefill_logits_and_greedy_tokens_match_transformers(tiny_models, name):
    folder, hf = tiny_models[name]
    cfg, runner = _runner(folder, "float32")
    assert_matches_transformers(runner, hf, cfg, PROMPT_LEN, NEW_TOKENS)


@needs_onednn
def test_one_copy_a_tied_head_stays_dense_and_serves_the_lookups(tiny_models):
    cfg, runner = _runner(tiny_models["llama-mha-tied"][0], "float32")
    model = runner.model
    assert cfg.tie_word_embeddings and model.embed is None
    assert isinstance(model.lm_head, torch.Tensor)
    assert all(isinstance(p, PackedLinear) for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up))
    _, dense = _runner(tiny_models["llama-mha-tied"][0], None)
    assert model.weight_bytes == dense.model.weight_bytes  # float32's bytes, held once
    ids = torch.tensor([3, 5, 7])
    assert torch.equal(model.embed_tokens(ids), dense.model.embed_tokens(ids))


@needs_onednn
def test_an_untied_head_is_packed_and_the_embedding_kept_dense(tiny_models):
    cfg, runner = _runner(tiny_models["llama-gqa"][0], "float32")
    assert not cfg.tie_word_embeddings
    assert isinstance(runner.model.lm_head, PackedLinear)
    assert isinstance(runner.model.embed, torch.Tensor) and runner.model.embed.dtype == torch.float32
    _, dense = _runner(tiny_models["llama-gqa"][0], None)
    assert runner.model.weight_bytes == dense.model.weight_bytes


@needs_onednn
def test_a_packed_float32_model_neither_writes_nor_reads_a_layout(tiny_models, tmp_path, monkeypatch):
    import shutil

    from minengine.checkpoint import layout_cache

    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama-gqa"][0], folder)
    _runner(folder, "float32")
    assert not list((folder / layout_cache.CACHE_DIR).glob("layout-*"))
    _, dense = _runner(folder, None)  # writes the dense layout
    assert list((folder / layout_cache.CACHE_DIR).glob("layout-*"))
    _, packed = _runner(folder, "float32")
    assert isinstance(packed.model.layers[0].qkv, PackedLinear)  # built from the checkpoint, not the layout
    cfg = ModelConfig.from_file(folder)
    ids = _prompt(cfg.vocab_size)
    torch.testing.assert_close(
        packed.forward(ids, 0, _cache(cfg)), dense.forward(ids, 0, _cache(cfg)), rtol=0, atol=1e-4
    )
