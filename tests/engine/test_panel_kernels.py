"""reqscope's panel kernel (float32, fp16, q8_0 and q4_1 panels): products against float64, a row's bits
whatever rows share its call, Q8_0's and Q4_1's blocks, the model under each storage, choosing it, and falling back.

Tolerances: a float32 panel product is one float32 FMA chain per output, within 1e-6 relative
of float64 (fp16's: of float64's product of the half-rounded weights); q8_0 rounds each weight
to 8 bits within its block of 32 (relative error of a product about 0.5%, bound 1%); q4_1 to 4
bits (a weight's error about 8%), but weights that came from Q4_1 blocks it holds exactly. The tiny
models' logits under float32 panels stay within transformers' 1e-4, as the dense operands' do.

The block formats multiply float32 rows here (`REQSCOPE_ACTIVATIONS=float32`, set for every test):
rows rounded to int16 or int8 are test_dot8.py's, beside one check below of int16 on a whole model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SPECS, TinySpec, build_tiny_with_tokenizer
from transformers_parity import assert_matches_transformers

from minengine.checkpoint import layout_cache, weight_format
from minengine.checkpoint.weight_format import FLOAT32_KERNEL_ENV, WeightFormatError, resolve_weights
from minengine.config import ModelConfig
from minengine.engine.engine import Engine
from minengine.fast import cpu_kernels
from minengine.fast.cpu_kernels import KernelLibrary, library
from minengine.fast.panel_kernels import (
    ACTIVATIONS_ENV,
    PANEL,
    Q8_BLOCK,
    UNPACK_MAX_ELEMENTS,
    UNPACK_ROWS,
    PanelLinear,
    block_refusal,
)
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")
SHAPES = [(960, 576), (576, 1536), (49152, 576), (100, 64), (17, 96)]
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 31, 64, 70)
PROMPT_LEN, NEW_TOKENS = 20, 16

needs_kernel = pytest.mark.skipif(library().lib is None, reason=library().why_not)


@pytest.fixture(autouse=True)
def float32_rows(monkeypatch):
    """The block formats' float32 arithmetic: gguf's float32 weights times float32 rows."""
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")


def _weight(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _x(rows, features, seed=1):
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


# -- the kernel -----------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_panels_are_float64s_product_to_float32_rounding(shape):
    w = _weight(shape)
    panel = PanelLinear("float32", w, 1)
    assert panel.shape == (1, shape[1], shape[0])
    assert panel.stored_bytes == -(-shape[0] // PANEL) * PANEL * shape[1] * 4  # float32, padded to whole panels
    for rows in ROWS:
        x = _x(rows, shape[1])
        y = panel.linear(x)
        assert y.shape == (rows, shape[0]) and y.is_contiguous()
        assert _rel(y, x.double() @ w.double().t()) < 1e-6


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_fp16_panels_multiply_by_the_half_rounded_weights_in_float32(shape):
    w = _weight(shape)
    panel = PanelLinear("fp16", w, 1)
    rounded = w.half()
    assert torch.equal(panel.rows(torch.arange(shape[0])), rounded.float())  # IEEE half, round to nearest even
    assert panel.stored_bytes == -(-shape[0] // PANEL) * PANEL * shape[1] * 2
    for rows in ROWS:
        x = _x(rows, shape[1])
        y = panel.linear(x)
        assert _rel(y, x.double() @ rounded.double().t()) < 1e-6  # float32 arithmetic on the stored weights
        assert _rel(y, x.double() @ w.double().t()) < 1e-3  # and near float32's


def _q8_0_reference(w: torch.Tensor) -> torch.Tensor:
    """Q8_0 as llama.cpp defines it, written independently: per 32 inputs of a row, scale absmax/127."""
    out, k = w.shape
    blocks = w.double().view(out, k // Q8_BLOCK, Q8_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / scale).clamp(-127, 127) * scale).view(out, k)


@needs_kernel
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % Q8_BLOCK == 0])
def test_q8_0_panels_hold_q8_0s_blocks_and_multiply_by_them(shape):
    w = _weight(shape)
    panel = PanelLinear("q8_0", w, 1)
    dequantized = _q8_0_reference(w)
    ids = torch.arange(shape[0])
    off = (panel.rows(ids).double() - dequantized).abs()
    # float32 scales: the same integers but where w/scale lands on a rounding tie (a few in a million)
    assert (off > 1e-7).double().mean() < 1e-5 and off.max() < 1e-3
    panels = -(-shape[0] // PANEL)
    assert panel.stored_bytes == panels * PANEL * shape[1] * (1 + 4 / Q8_BLOCK)  # int8 + a float32 scale per 32
    stored = panel.rows(ids).double()
    for rows in ROWS:
        x = _x(rows, shape[1])
        y = panel.linear(x)
        assert _rel(y, x.double() @ stored.t()) < 1e-6  # the product of the stored weights
        assert _rel(y, x.double() @ w.double().t()) < 1e-2  # and near float32's


def _q4_1_reference(w: torch.Tensor) -> torch.Tensor:
    """Q4_1 as llama.cpp defines it, written independently: per 32 inputs of a row, d = (max - min) / 15
    and m = min, both stored in fp16, q = round((w - m) / d) in 0..15, dequantized q * d + m."""
    out, k = w.shape
    blocks = w.view(out, k // Q8_BLOCK, Q8_BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    q = torch.round((blocks - m) / d).clamp(0, 15)
    return (q * d + m).view(out, k)


@needs_kernel
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % Q8_BLOCK == 0])
def test_q4_1_panels_hold_q4_1s_blocks_and_multiply_by_them(shape):
    w = _weight(shape)
    panel = PanelLinear("q4_1", w, 1)
    ids = torch.arange(shape[0])
    stored = panel.rows(ids)
    assert torch.equal(stored, _q4_1_reference(w))
    panels = -(-shape[0] // PANEL)
    assert panel.stored_bytes == panels * PANEL * shape[1] * (0.5 + 4 / Q8_BLOCK)  # 4 bits + fp16 d and m per 32
    for rows in ROWS:
        x = _x(rows, shape[1])
        y = panel.linear(x)
        assert _rel(y, x.double() @ stored.double().t()) < 1e-6  # the product of the stored weights
        assert _rel(y, x.double() @ w.double().t()) < 0.15  # 4 bits: near float32's, not close


@needs_kernel
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % Q8_BLOCK == 0])
def test_weights_from_q4_1_blocks_are_held_exactly_and_give_float32_panels_bits(shape):
    """A checkpoint converted from a Q4_1 GGUF holds gguf's dequantized float32: q4_1 panels keep
    those very values and multiply by them in float32 panels' order."""
    w = _q4_1_reference(_weight(shape))
    q4, f32 = PanelLinear("q4_1", w, 1), PanelLinear("float32", w, 1)
    assert torch.equal(q4.rows(torch.arange(shape[0])), w)
    for rows in ROWS:
        x = _x(rows, shape[1])
        assert torch.equal(q4.linear(x), f32.linear(x)), rows


@needs_kernel
@pytest.mark.parametrize("fmt", ["float32", "fp16", "q8_0", "q4_1"])
@pytest.mark.parametrize("shape", [(960, 576), (100, 64), (49152, 576)])
def test_a_long_prompt_chunk_multiplies_the_weight_laid_back_out(fmt, shape):
    """From UNPACK_ROWS rows the product is MKL's over the stored weight laid out densely (the
    vocabulary head, too large for the scratch, keeps the panel tiles): the same product either way."""
    w = _weight(shape)
    panel = PanelLinear(fmt, w, 1)
    stored = panel.rows(torch.arange(shape[0]))  # as stored: fp16 converted, q8_0 and q4_1 dequantized
    for rows in (UNPACK_ROWS - 1, UNPACK_ROWS, 300):
        x = _x(rows, shape[1])
        y = panel.linear(x)
        assert y.shape == (rows, shape[0]) and y.is_contiguous()
        assert _rel(y, x.double() @ stored.double().t()) < 1e-6
        into = torch.empty(rows, shape[0])
        assert panel.linear(x, out=into) is into and torch.equal(into, y)
        if rows >= UNPACK_ROWS and shape[0] * shape[1] <= UNPACK_MAX_ELEMENTS:
            torch.testing.assert_close(y, F.linear(x, stored), rtol=0, atol=1e-5)
    assert shape[0] * shape[1] > UNPACK_MAX_ELEMENTS or torch.equal(panel._unpacked(), stored)


@needs_kernel
@pytest.mark.parametrize("fmt", ["float32", "fp16", "q8_0", "q4_1"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (96, 64)])
def test_a_rows_product_is_the_same_bits_whatever_rows_and_threads_share_the_call(fmt, shape):
    panel = PanelLinear(fmt, _weight(shape), 1)
    x = _x(70, shape[1])
    alone = torch.cat([panel.linear(x[i : i + 1]) for i in range(x.shape[0])])
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            for rows in (*range(2, 17), 31, 64, 65, 70):
                assert torch.equal(panel.linear(x[:rows]), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"), reason="no AVX-512 here")
@pytest.mark.parametrize("fmt", ["float32", "fp16", "q8_0", "q4_1"])
def test_the_avx512_tiles_give_the_avx2_builds_bits(fmt, tmp_path):
    import ctypes

    avx2 = KernelLibrary(ctypes.CDLL(str(cpu_kernels._build(cpu_kernels._compiler(), tmp_path, cpu_kernels.FLAGS))))
    for shape in [(960, 576), (576, 1536), (96, 64)]:
        panel = PanelLinear(fmt, _weight(shape), 1)
        x = _x(70, shape[1])
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 70):
            wide = panel.linear(x[:rows])
            panel._lib = avx2.lib
            narrow = panel.linear(x[:rows])
            panel._lib = library().lib
            assert torch.equal(wide, narrow), (shape, rows)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_formats_refuse_inputs_not_in_blocks_of_32(fmt):
    with pytest.raises(ValueError, match=f"40 input features, not a whole number of {fmt}'s 32-input blocks"):
        PanelLinear(fmt, _weight((64, 40)), 1)
    assert block_refusal(fmt, "w", (64, 64)) is None


# -- building the kernel --------------------------------------------------------------------------


def test_without_a_compiler_the_library_says_why_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_kernels, "kernels_home", lambda: tmp_path / "kernels")
    found = cpu_kernels.library.__wrapped__()  # past the per-process cache
    if found.lib is None and "AVX2" in found.why_not or "x86-64" in found.why_not:
        pytest.skip(found.why_not)
    assert found.lib is None
    assert found.why_not and "\n" not in found.why_not
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind


@needs_kernel
def test_a_build_is_kept_and_reused(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "kernels_home", lambda: tmp_path / "kernels")
    first = cpu_kernels.library.__wrapped__()
    built = list((tmp_path / "kernels").glob("reqscope_kernels-*.so"))
    assert first.lib is not None and len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert cpu_kernels.library.__wrapped__().lib is not None
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [stamp]


# -- in the model ---------------------------------------------------------------------------------


def _runner(folder, packs):
    cfg = ModelConfig.from_file(folder)
    return cfg, ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs=packs))


def _cache(cfg):
    return KVCache(cfg, PROMPT_LEN + NEW_TOKENS, device=CPU, compute_dtype=torch.float32)


def _prompt(vocab):
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))


@needs_kernel
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_float32_panels_match_transformers_logits_and_greedy_tokens(tiny_models, name):
    folder, hf = tiny_models[name]
    cfg, runner = _runner(folder, "float32-panels")
    assert_matches_transformers(runner, hf, cfg, PROMPT_LEN, NEW_TOKENS)


def _kl(ref, other):
    return F.kl_div(F.log_softmax(other, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)


def _against_float32(folder, packs):
    """A tiny model's logits at every prompt position: dense float32's, then under `packs`."""
    cfg, dense = _runner(folder, None)
    _, other = _runner(folder, packs)
    ids = _prompt(cfg.vocab_size)
    return tuple(r.model.forward(ids, 0, _cache(cfg), all_logits=True) for r in (dense, other))


@needs_kernel
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_q8_0_stays_near_float32_on_the_tiny_models(tiny_models, name):
    ref, ours = _against_float32(tiny_models[name][0], "q8_0")
    assert _kl(ref, ours).max() < 1e-3


def _through_gguf_blocks(folder, into):
    """A copy of a model folder whose weights went through Q4_1 (the layers' projections) and Q8_0 (the
    embedding and head), as a checkpoint converted from a Q4_1 GGUF holds them."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    for path in into.glob("*.safetensors"):
        sd = load_file(path)
        for name, w in sd.items():
            if w.dim() == 2 and "embed" not in name and "lm_head" not in name:
                sd[name] = _q4_1_reference(w)
            elif w.dim() == 2:  # Q8_0 with GGUF's fp16 scale
                blocks = w.view(w.shape[0], -1, Q8_BLOCK)
                d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
                sd[name] = (torch.round(blocks / d).clamp(-127, 127) * d).view_as(w)
        save_file(sd, path, metadata={"format": "pt"})
    return into


@needs_kernel
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "qwen2"])
def test_q4_1_runs_a_q4_1_checkpoint_with_float32_panels_logits(tiny_models, tmp_path, monkeypatch, name):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "0")
    folder = _through_gguf_blocks(tiny_models[name][0], tmp_path / name)
    cfg, f32 = _runner(folder, "float32-panels")
    _, q4 = _runner(folder, "q4_1")
    assert q4.model.layers[0].qkv.format == "q4_1" and q4.model.lm_head.format == "q8_0"  # the head 8 bits, as GGUF
    assert q4.model.weight_bytes < 0.3 * f32.model.weight_bytes
    ids = _prompt(cfg.vocab_size)
    caches = _cache(cfg), _cache(cfg)
    assert torch.equal(q4.forward(ids, 0, caches[0]), f32.forward(ids, 0, caches[1]))
    token = torch.tensor([5])
    for pos in range(PROMPT_LEN, PROMPT_LEN + 4):
        assert torch.equal(q4.forward(token, pos, caches[0]), f32.forward(token, pos, caches[1]))


@pytest.mark.skipif(
    library().lib is None or not library().lib.dot8_native(), reason="int16 activations need AVX-512 VNNI"
)
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-tied", "qwen2"])
def test_with_int16_activations_a_q4_1_checkpoints_logits_stay_near_float32_panels(
    tiny_models, tmp_path, monkeypatch, name
):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "0")
    folder = _through_gguf_blocks(tiny_models[name][0], tmp_path / name)
    cfg, f32 = _runner(folder, "float32-panels")
    monkeypatch.setenv(ACTIVATIONS_ENV, "int16")
    _, q4 = _runner(folder, "q4_1")
    assert q4.model.layers[0].qkv.rounding == "int16"
    ids = _prompt(cfg.vocab_size)
    caches = _cache(cfg), _cache(cfg)
    got, want = q4.forward(ids, 0, caches[0]), f32.forward(ids, 0, caches[1])
    token = torch.tensor([5])
    for pos in range(PROMPT_LEN, PROMPT_LEN + 4):
        assert 0 < _rel(got, want) < 1e-4  # rounded rows: near float32's logits, not their bits
        got, want = q4.forward(token, pos, caches[0]), f32.forward(token, pos, caches[1])


@needs_kernel
def test_auto_takes_q4_1_only_for_a_checkpoint_of_q4_1_blocks(chatty_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "0")
    random = chatty_tiny_dir
    blocks = _through_gguf_blocks(random, tmp_path / "blocks")
    assert not weight_format.q4_1_holds(random) and weight_format.q4_1_holds(blocks)
    assert Engine(random, device="cpu", weights="auto").weights.format == "fp16"
    engine = Engine(blocks, device="cpu", weights="auto")
    choice = engine.weights
    assert (choice.format, choice.packs) == ("q4_1", "q4_1-exact") and "Q4_1 blocks, held exactly" in choice.why
    layer = engine.model.layers[0]
    assert {layer.qkv.format, layer.down.format, engine.model.lm_head.format} == {"q4_1", "q8_0"}
    cfg, f32 = _runner(blocks, "float32-panels")
    ids = _prompt(cfg.vocab_size)
    assert torch.equal(ModelRunner(engine.model).forward(ids, 0, _cache(cfg)), f32.forward(ids, 0, _cache(cfg)))


@needs_kernel
def test_under_auto_a_projection_q4_1_would_round_is_kept_in_fp16(chatty_tiny_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv(layout_cache.DISABLE_ENV, "0")
    folder = _through_gguf_blocks(chatty_tiny_dir, tmp_path / "mixed")
    (path,) = folder.glob("*.safetensors")
    sd = load_file(path)
    sd["model.layers.1.mlp.down_proj.weight"] = _weight(tuple(sd["model.layers.1.mlp.down_proj.weight"].shape))
    save_file(sd, path, metadata={"format": "pt"})
    assert weight_format.q4_1_holds(folder)  # the probe reads the first layer only
    model = Engine(folder, device="cpu", weights="auto").model
    assert [layer.down.format for layer in model.layers] == ["q4_1", "fp16"]
    assert model.layers[1].down.holds(sd["model.layers.1.mlp.down_proj.weight"].half().float())
    assert Engine(folder, device="cpu", weights="q4_1").model.layers[1].down.format == "q4_1"  # asked for: rounded


@needs_kernel
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_fp16_panels_keep_float32s_greedy_tokens_on_the_tiny_models(tiny_models, name):
    ref, ours = _against_float32(tiny_models[name][0], "fp16-panels")
    assert _kl(ref, ours).max() < 1e-5
    assert torch.equal(ref.argmax(-1), ours.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("packs", ["q8_0", "float32-panels", "fp16-panels", "q4_1"])
def test_the_lean_step_and_a_batched_step_give_the_general_paths_logits(tiny_models, packs):
    from minengine.steps.rows import Row

    cfg, runner = _runner(tiny_models["llama-gqa"][0], packs)
    ids = _prompt(cfg.vocab_size)
    general, lean = _cache(cfg), _cache(cfg)
    runner.model.forward(ids, 0, general)
    runner.forward(ids, 0, lean)
    token = torch.tensor([7])
    want = runner.model.forward(token, PROMPT_LEN, general)
    assert runner.eager_decoder.serves(lean, PROMPT_LEN)
    torch.testing.assert_close(runner.forward(token, PROMPT_LEN, lean), want, rtol=0, atol=1e-5)
    others = [_cache(cfg) for _ in range(3)]
    for c in others:
        runner.forward(ids, 0, c)
    rows = [Row((7,), PROMPT_LEN, c, True) for c in others]
    for got in runner.forward_rows(rows):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("packs", ["q8_0", "float32-panels", "fp16-panels", "q4_1"])
def test_one_copy_the_tied_heads_panels_serve_the_lookups(tiny_models, packs):
    cfg, runner = _runner(tiny_models["llama-mha-tied"][0], packs)
    model = runner.model
    assert cfg.tie_word_embeddings and model.embed is None and isinstance(model.lm_head, PanelLinear)
    _, dense = _runner(tiny_models["llama-mha-tied"][0], None)
    ids = torch.tensor([0, 3, 5, cfg.vocab_size - 1])
    rows = model.embed_tokens(ids)
    if packs == "float32-panels":
        assert torch.equal(rows, dense.model.embed_tokens(ids))
        assert model.weight_bytes >= dense.model.weight_bytes  # float32's bytes (padding to whole panels)
    elif packs == "fp16-panels":
        assert torch.equal(rows, dense.model.embed_tokens(ids).half().float())
        assert model.weight_bytes < 0.55 * dense.model.weight_bytes  # half of float32's, held once
    else:  # q8_0, and q4_1's head (8 bits, as a Q4_1 GGUF keeps it)
        torch.testing.assert_close(rows, dense.model.embed_tokens(ids), rtol=0.01, atol=2e-3)
        assert model.weight_bytes < 0.3 * dense.model.weight_bytes  # about 9/32 of float32's, held once


# -- choosing it ----------------------------------------------------------------------------------


@needs_kernel
def test_q8_0_is_asked_for_and_the_float32_panels_taken_from_the_environment(monkeypatch):
    choice = resolve_weights("q8_0", CPU, torch.float32)
    assert (choice.format, choice.packed, choice.panels, choice.packs) == ("q8_0", True, True, "q8_0")
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "panels")
    choice = resolve_weights("float32", CPU, torch.float32)
    assert choice.packs == "float32-panels" and "panel kernel" in choice.why
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "dense")
    assert resolve_weights("float32", CPU, torch.float32).packs is None
    choice = resolve_weights("fp16", CPU, torch.float32)  # the panels whatever float32's kernel
    assert (choice.format, choice.packs) == ("fp16", "fp16-panels")
    assert choice.why == "asked for, through reqscope's panel kernel"


def test_without_the_kernel_q8_0_is_refused_and_float32_stays_dense(monkeypatch):
    monkeypatch.setattr(weight_format, "library", lambda: KernelLibrary(None, "no C compiler (cc) was found"))
    with pytest.raises(WeightFormatError, match="q8_0 weights cannot run: no C compiler") as info:
        resolve_weights("q8_0", CPU, torch.float32)
    assert "\n" not in str(info.value)
    monkeypatch.setenv(FLOAT32_KERNEL_ENV, "panels")
    choice = resolve_weights("float32", CPU, torch.float32)
    assert choice.packs is None and "dense, since no C compiler" in choice.why
    if weight_format.available("fp16").ok:  # fp16 falls back to FBGEMM's packed kernel, saying why
        choice = resolve_weights("fp16", CPU, torch.float32)
        assert choice.packs == "fp16" and not choice.panels
        assert "FBGEMM's packed fp16, since no C compiler" in choice.why


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_formats_on_cuda_are_refused(fmt):
    with pytest.raises(WeightFormatError, match=f"{fmt} weights have no cuda kernel here"):
        resolve_weights(fmt, torch.device("cuda"), torch.float16)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_block_formats_refuse_a_model_whose_inputs_are_not_in_blocks_of_32(tiny_models, tmp_path, monkeypatch, fmt):
    folder = tmp_path / "odd"
    spec = TinySpec("odd", "llama", {"hidden_size": 40, "num_attention_heads": 2, "num_key_value_heads": 1,
                                     "intermediate_size": 64, "num_hidden_layers": 1})  # fmt: skip
    build_tiny_with_tokenizer(spec, folder, tiny_models["llama-gqa"][0])
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    with pytest.raises(WeightFormatError, match=f"has 40 input features, not a whole number of {fmt}") as info:
        Engine(folder, device="cpu", weights=fmt)
    assert "\n" not in str(info.value)
    assert not (folder / layout_cache.CACHE_DIR).exists()


# -- the layout cache -----------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("packs", ["q8_0", "float32-panels", "fp16-panels", "q4_1"])
def test_a_panel_layout_is_cached_beside_the_dense_one_and_mapped_back(tiny_models, tmp_path, monkeypatch, packs):
    import shutil

    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama-gqa"][0], folder)
    cfg, dense = _runner(folder, None)
    _, built = _runner(folder, packs)  # builds its panels and writes them
    files = sorted(p.name for p in (folder / layout_cache.CACHE_DIR).glob("layout-*.safetensors"))
    assert len(files) == 2 and [f for f in files if f.startswith(f"layout-{packs}-")]  # the dense one kept
    (panel_file,) = (folder / layout_cache.CACHE_DIR).glob(f"layout-{packs}-*.safetensors")
    written = panel_file.stat().st_mtime_ns
    _, mapped = _runner(folder, packs)  # maps them back: the file is read, not written again
    assert panel_file.stat().st_mtime_ns == written
    layer = mapped.model.layers[0]
    assert isinstance(layer.qkv, PanelLinear) and layer.qkv.format == built.model.layers[0].qkv.format
    ids = torch.randint(3, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(mapped.forward(ids, 0, _cache(cfg)), built.forward(ids, 0, _cache(cfg)))
    assert torch.equal(dense.forward(ids, 0, _cache(cfg)), _runner(folder, None)[1].forward(ids, 0, _cache(cfg)))
