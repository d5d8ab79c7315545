"""Weight formats against float32: next-token distributions, greedy tokens, bytes, and what `auto` picks.

Parity with transformers is tested in float32 (test_model_parity); here each packed format is
held to float32 on the same engine. Bounds (KL of the next-token distributions, in nats):
fp16 stays within 1e-5 per position on the tiny models and 1e-3 per step on the default model,
with the same greedy tokens on its benchmark prompt; int8 within 1e-2 per position on the
tiny models and 0.5 mean per step on the default model (measured 0.18: its activations are
quantized per tensor to 7 bits, and its greedy tokens part from float32's at once, which is why
`auto` does not take it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import shutil

import pytest
import torch
import torch.nn.functional as F
from tiny_models import SPECS

from minengine.checkpoint import layout_cache, weight_format
from minengine.checkpoint.weight_format import AUTO_CPU_ORDER, AUTO_MAX_KL, WeightFormatError, resolve_weights
from minengine.config import ModelConfig
from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.fast.cpu_kernels import KernelLibrary, library
from minengine.fast.linear_kernels import PackedLinear, available
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")
PACKED = [f for f in ("fp16", "int8", "bf16") if available(f).ok]
TINY_KL = {"fp16": 1e-5, "int8": 1e-2, "bf16": 1e-3}
PROMPT_LEN = 20


def _kl(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return F.kl_div(F.log_softmax(other, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)


def _model(folder, packs=None):
    cfg = ModelConfig.from_file(folder)
    return cfg, load_model(folder, cfg, torch.float32, CPU, packs=packs)


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))


def _cache(cfg, tokens=PROMPT_LEN + 8):
    return KVCache(cfg, tokens, device=CPU, compute_dtype=torch.float32)


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_each_format_stays_near_float32_on_the_tiny_models(tiny_models, name, fmt):
    folder, _ = tiny_models[name]
    cfg, ref = _model(folder)
    _, packed = _model(folder, fmt)
    ids = _prompt(cfg.vocab_size)
    ours = packed.forward(ids, 0, _cache(cfg), all_logits=True)
    theirs = ref.forward(ids, 0, _cache(cfg), all_logits=True)
    assert _kl(theirs, ours).max() < TINY_KL[fmt]


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "llama-mha-tied"])
def test_the_lean_decode_step_gives_the_general_paths_logits(tiny_models, name, fmt):
    """The eager step (scratch buffers), the static step and `forward` run the same packed products."""
    folder, _ = tiny_models[name]
    cfg, model = _model(folder, fmt)
    ids = _prompt(cfg.vocab_size)
    general, lean, static = _cache(cfg), _cache(cfg), _cache(cfg)
    eager_runner, static_runner = ModelRunner(model), ModelRunner(model, static_decode=True)
    static_runner.use_static_decode(True, capture=False)
    static = static_runner.new_cache(PROMPT_LEN + 8)
    model.forward(ids, 0, general)
    eager_runner.forward(ids, 0, lean)
    static_runner.forward(ids, 0, static)
    token = torch.tensor([7])
    want = model.forward(token, PROMPT_LEN, general)
    assert eager_runner.eager_decoder.serves(lean, PROMPT_LEN)
    torch.testing.assert_close(eager_runner.forward(token, PROMPT_LEN, lean), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(static_runner.forward(token, PROMPT_LEN, static), want, rtol=0, atol=1e-5)


# -- bytes --------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                  "keepcost")
    ]  # fmt: skip


def _allocated() -> int:
    """Bytes glibc's malloc has handed out and not taken back (FBGEMM allocates through it)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("fmt", [f for f in PACKED if f != "bf16"])
@pytest.mark.parametrize(
    "shape",
    [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (200, 100), (17, 513), (128, 64)],
)
def test_the_bytes_counted_are_the_bytes_stored(fmt, shape):
    """A packed weight's `stored_bytes` is what the allocator gave out for it (within malloc's slack)."""
    try:
        _allocated()
    except (OSError, AttributeError):
        pytest.skip("glibc's mallinfo2 is not available here")
    weight = torch.randn(*shape)
    kept = []
    # Garbage from earlier tests (an engine's KV pool) must not be collected mid-measurement.
    gc.collect()
    gc.disable()
    try:
        before = _allocated()
        kept.append(PackedLinear(fmt, weight, 1))
        grown = _allocated() - before
    finally:
        gc.enable()
    packed = kept[0]
    # malloc's slack: a few small bookkeeping allocations (up to ~3 KiB measured with AVX2; FBGEMM's
    # AVX-512 int8 path adds 7-17 KiB beside a small weight, measured on a Xeon), 1% on large ones
    slack = 20 << 10 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 4096
    assert abs(grown - packed.stored_bytes) <= slack + packed.stored_bytes // 100, (grown, packed.stored_bytes)
    out, k = shape
    elem = {"fp16": 2, "int8": 1}[fmt]
    assert k * out * elem <= packed.read_bytes <= packed.stored_bytes


@pytest.mark.parametrize("fmt", PACKED)
def test_a_model_counts_its_packed_bytes(tiny_models, fmt):
    cfg, model = _model(tiny_models["llama-mha-tied"][0], fmt)
    packed = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(p, PackedLinear) for p in packed)
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * 4
    embed = model.embed.stored_bytes
    assert model.weight_bytes == embed + norms + sum(p.stored_bytes for p in packed)
    assert model.decode_weight_bytes == model.embed.row_bytes + norms + sum(p.read_bytes for p in packed)
    _, dense = _model(tiny_models["llama-mha-tied"][0])
    assert model.decode_weight_bytes < dense.decode_weight_bytes


# -- choosing the format -------------------------------------------------------------------------


def test_auto_takes_the_measured_format_on_the_cpu(monkeypatch):
    choice = resolve_weights("auto", CPU, torch.float32)
    kernel = library().lib is not None
    assert AUTO_CPU_ORDER == ("q4_1", "fp16", "float32")  # q4_1 only for a checkpoint of its blocks
    assert (choice.format, choice.panels) == (("fp16", True) if kernel else ("float32", False))
    assert choice.why.startswith("auto: ")
    monkeypatch.setattr(weight_format, "library", lambda: KernelLibrary(None, "no C compiler (cc) was found"))
    choice = resolve_weights("auto", CPU, torch.float32)  # not FBGEMM's fp16: it did not pay
    assert choice.format == "float32" and not choice.packed
    none = "no C compiler (cc) was found"
    assert choice.why == f"auto: no packed format pays here (q4_1: {none}; fp16: {none}); dense, since {none}"
    assert resolve_weights("int8", CPU, torch.float32).why == "asked for"


def test_auto_elsewhere_is_the_compute_dtypes_own():
    cuda = torch.device("cuda")
    assert resolve_weights("auto", cuda, torch.bfloat16).format == "bf16"
    assert resolve_weights("auto", cuda, torch.float16).format == "fp16"
    assert resolve_weights("auto", CPU, torch.bfloat16).format == "bf16"
    assert not resolve_weights("fp16", cuda, torch.float16).packed


@pytest.mark.parametrize(
    ("name", "device", "dtype", "needle"),
    [
        ("int8", "cuda", torch.bfloat16, "int8 weights have no cuda kernel here; use weights bf16"),
        (
            "fp16",
            "cuda",
            torch.bfloat16,
            "stored in the compute dtype \\(bfloat16\\); for fp16 weights use dtype float16 or dtype auto",
        ),
        ("int8", "cpu", torch.bfloat16, "need float32 compute on the CPU"),
    ],
)
def test_formats_the_device_cannot_run_are_refused(name, device, dtype, needle):
    with pytest.raises(WeightFormatError, match=needle) as info:
        resolve_weights(name, torch.device(device), dtype)
    assert "\n" not in str(info.value)


def test_a_format_this_cpu_lacks_is_refused_before_loading(chatty_tiny_dir, monkeypatch, tmp_path):
    missing = next((f for f in ("bf16", "int8", "fp16") if not available(f).ok), None)
    if missing is None:
        pytest.skip("this CPU and torch run every packed kernel")
    with pytest.raises(WeightFormatError, match=f"{missing} weights cannot run: ") as info:
        Engine(chatty_tiny_dir, device="cpu", weights=missing)
    assert "\n" not in str(info.value)


def test_int8_refuses_a_model_whose_shapes_overflow_its_accumulator(tiny_models, tmp_path, monkeypatch):
    from tiny_models import TinySpec, build_tiny_with_tokenizer

    folder = tmp_path / "wide"
    spec = TinySpec("wide", "llama", {"hidden_size": 8, "num_attention_heads": 1, "num_key_value_heads": 1,
                                      "intermediate_size": 140_000, "num_hidden_layers": 1})  # fmt: skip
    build_tiny_with_tokenizer(spec, folder, tiny_models["llama-gqa"][0])
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    with pytest.raises(WeightFormatError, match="down_proj.weight has 140000 input features") as info:
        Engine(folder, device="cpu", weights="int8")
    assert "\n" not in str(info.value)
    assert not (folder / layout_cache.CACHE_DIR).exists()  # nothing written


# -- identity: nothing made under one format is reused under another ------------------------------


def test_the_prefix_cache_identity_and_trace_header_name_the_format(chatty_tiny_dir):
    from minengine.record.trace_io import trace_header

    dense = Engine(chatty_tiny_dir, device="cpu", weights="float32", kv_budget_bytes=64 << 20)
    packed = Engine(chatty_tiny_dir, device="cpu", weights=PACKED[0], kv_budget_bytes=64 << 20)
    assert dense.kv_identity("gqa", torch.float32, 16) != packed.kv_identity("gqa", torch.float32, 16)
    assert packed.kv_identity("gqa", torch.float32, 16).weights == PACKED[0]
    header = trace_header(packed)
    assert (header.weights, header.weights_why) == (PACKED[0], packed.weights.why)
    assert packed.weights.why.startswith("asked for")
    assert f"weights {PACKED[0]} ({packed.weights.why})" in packed.describe()


def test_a_layout_made_for_another_format_is_rebuilt_not_read(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama-gqa"][0], folder)
    cfg, built = _model(folder)
    (path,) = (folder / layout_cache.CACHE_DIR).glob("layout-*.safetensors")
    tensors = layout_cache.open_layout(path, "float32").tensors
    # The same file, claiming another format: it must not be mapped as float32's operands.
    assert layout_cache.write_layout(path, {k: v.clone() for k, v in tensors.items()}, "bf16")
    assert layout_cache.open_layout(path, "float32") is None
    _, again = _model(folder)
    assert layout_cache.open_layout(path, "float32") is not None  # rebuilt for float32
    ids = _prompt(cfg.vocab_size)
    assert torch.equal(again.forward(ids, 0, _cache(cfg)), built.forward(ids, 0, _cache(cfg)))


def test_a_packed_format_writes_no_layout(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["llama-gqa"][0], folder)
    _model(folder, PACKED[0])
    assert not list((folder / layout_cache.CACHE_DIR).glob("layout-*"))


# -- the default model ------------------------------------------------------------------------


def _greedy_logits(engine: Engine, ids: list[int], steps: int, forced: list[int] | None = None):
    cache = engine.runner.new_cache(len(ids) + steps + 1)
    logits = engine.runner.forward(torch.tensor(ids), 0, cache)
    rows, tokens = [], []
    for i in range(steps):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        logits = engine.runner.forward(torch.tensor([forced[i] if forced else tokens[-1]]), len(ids) + i, cache)
    cache.release()
    return torch.stack(rows), tokens


@pytest.mark.slow
@pytest.mark.parametrize("fmt", PACKED)
def test_each_format_on_the_default_models_benchmark_prompt(default_model_dir, default_engine, fmt):
    steps = 48
    engine = Engine(default_model_dir, device="cpu", weights=fmt, kv_budget_bytes=1 << 30)
    tok = default_engine.tokenizer
    ids = tok.encode(
        tok.render(list(GenerationRequest.from_prompt("Show me wheelchair-accessible hotels in Kyoto").messages))
    )
    ref_logits, ref_tokens = _greedy_logits(default_engine, ids, steps)
    logits, _ = _greedy_logits(engine, ids, steps, forced=ref_tokens)
    kl = _kl(ref_logits, logits)
    if fmt in AUTO_CPU_ORDER:  # what auto may pick: within its stated KL, with float32's greedy tokens
        assert kl.mean() < AUTO_MAX_KL
        assert _greedy_logits(engine, ids, steps)[1] == ref_tokens
    else:
        assert kl.mean() < 0.5
