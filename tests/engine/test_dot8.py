"""Rounded activations over q4_1 and q8_0 blocks (dot8_rows.c): int16 (the default on a VNNI CPU) and
int8 (llama.cpp's arithmetic). The VNNI tiles against the plain C reference bit for bit, the reference
against float64 arithmetic on the rounded rows, a row's bits whatever rows share its call, and the
choice through the environment.

The arithmetic: each row rounded per 32 inputs (scale max |x| / 127 for int8, / 32767 for int16, ties
to even), a block's products summed exactly in integers, then per block fma(S, d * dx, acc) and, for
q4_1, fma(m, dx * sum(xq), acc). So against float64 over the same rounded rows and the stored
weights, only float32's rounding of a few terms per block remains (1e-6 relative); against float32
rows the rounding of the activations does: about 0.4% of a product for int8, 1e-5 for int16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minengine.checkpoint.weight_format import resolve_weights
from minengine.checkpoint.weight_layout import KernelProduct
from minengine.fast.cpu_kernels import library
from minengine.fast.panel_kernels import ACTIVATIONS_ENV, PANEL, PanelLinear, activations
from minengine.fast.row_ops import c_silu_mul

CPU = torch.device("cpu")
SHAPES = [(960, 576), (576, 1536), (100, 64), (17, 96), (4096, 576)]  # whole groups, a partial one, a lone panel
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 17)
FORMATS = ("q4_1", "q8_0")

needs_kernel = pytest.mark.skipif(library().lib is None, reason=library().why_not)
needs_vnni = pytest.mark.skipif(
    library().lib is None or not library().lib.dot8_native(), reason="rounded activations need AVX-512 VNNI"
)
ROUNDINGS = ("int16", "int8")
TOP = {"int8": 127, "int16": 32767}  # a block's largest |x| rounds to this


def _weight(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _x(rows, features, seed=1):
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 30  # an outlier channel, as a model's residual stream has: its block's scale follows it
    return x


def _dot8(panel: PanelLinear, x: torch.Tensor, reference: bool = False, threads: int = 2) -> torch.Tensor:
    lib, rows = library().lib, x.shape[0]
    y = torch.empty(rows, panel.panel_count * PANEL)
    name = f"{panel.format}_{'dot16' if panel.rounding == 'int16' else 'dot8'}" + ("_reference" if reference else "")
    args = [x.contiguous().data_ptr(), rows, panel.in_features, panel.dot8.data_ptr(), panel.panel_count]
    getattr(lib, name)(*args, y.data_ptr(), y.shape[1], *(() if reference else (threads,)))
    return y[:, : panel.out_features]


def _rounded_rows(x: torch.Tensor, top: int) -> np.ndarray:
    """The rows rounded as dot8_rows.c rounds them (llama.cpp's Q8 for top 127), in float64: xq * d per block of 32."""
    blocks = x.double().numpy().reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(-1, keepdims=True).astype(np.float32) / np.float32(top)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d == 0, 1, d), 0).astype(np.float32)
    q = np.rint((blocks.astype(np.float32) * inv).astype(np.float32))  # float32 multiply, ties to even
    return (q * d.astype(np.float64)).reshape(x.shape[0], -1)


@pytest.fixture(params=ROUNDINGS)
def rounded(request, monkeypatch):
    """The activations each test runs under: int16, then int8."""
    monkeypatch.setenv(ACTIVATIONS_ENV, request.param)
    return request.param


@pytest.fixture
def int8(monkeypatch):
    monkeypatch.setenv(ACTIVATIONS_ENV, "int8")


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_reference_is_float64_over_the_rounded_rows_and_stored_weights(rounded, fmt, shape):
    panel = PanelLinear(fmt, _weight(shape), 1)
    assert panel.rounding == rounded
    stored = panel.rows(torch.arange(shape[0])).double().numpy()  # [out, in], the blocks' float32 values
    near = {"int8": 0.02, "int16": 2e-4}[rounded]  # the rows' rounding, against the largest output
    for rows in (1, 3, 8):
        x = _x(rows, shape[1])
        got = _dot8(panel, x, reference=True).double().numpy()
        want = _rounded_rows(x, TOP[rounded]) @ stored.T
        exact = x.double().numpy() @ stored.T
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(got - exact).max() <= near * np.abs(exact).max()  # near, not equal
        assert np.abs(got - exact).max() > near / 2000 * np.abs(exact).max()


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_int16_rows_land_a_hundred_times_nearer_float32s_products_than_int8(monkeypatch, fmt):
    w, x = _weight((960, 576)), _x(8, 576)
    exact = PanelLinear(fmt, w, 1).rows(torch.arange(960)).double() @ x.double().T
    errors = {}
    for rounding in ROUNDINGS:
        monkeypatch.setenv(ACTIVATIONS_ENV, rounding)
        errors[rounding] = (PanelLinear(fmt, w, 1).linear(x).double().T - exact).abs().max().item()
    assert errors["int16"] * 100 < errors["int8"]


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_with_a_nan_or_infinite_input_comes_out_nan_and_leaves_the_others_bits(rounded, fmt, bad):
    """float32's products turn a NaN or infinite input into NaN outputs; rounded rows do too, on the tiles
    and the reference alike, rather than numbers, and the rows beside it keep their bits."""
    panel = PanelLinear(fmt, _weight((96, 576)), 1)
    x = _x(9, 576)
    clean = _dot8(panel, x)
    x[4, 100] = bad
    for got in (_dot8(panel, x), _dot8(panel, x, reference=True)):
        assert torch.isnan(got[4]).all()
        keep = torch.arange(9) != 4
        assert torch.equal(got[keep], clean[keep])


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_vnni_tiles_give_the_references_bits_and_a_row_the_same_bits_in_any_batch(rounded, fmt, shape):
    panel = PanelLinear(fmt, _weight(shape), 1)
    alone = [_dot8(panel, _x(1, shape[1], seed=100 + r)) for r in range(max(ROWS))]
    for rows in ROWS:
        x = torch.cat([_x(1, shape[1], seed=100 + r) for r in range(rows)])
        got = _dot8(panel, x)
        assert torch.equal(got, _dot8(panel, x, reference=True)), rows
        assert torch.equal(got, torch.cat(alone[:rows])), rows
        assert torch.equal(panel.linear(x), got)  # the projection takes them


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("shape", "rows"), [((4080, 576), 80), ((100, 64), 2600)])
def test_an_output_past_the_caches_written_around_them_keeps_each_rows_bits(rounded, fmt, shape, rows):
    """From 1 MiB of output (AMX_STREAM_BYTES) a whole group's sums go to y in streaming stores where y's rows
    are 64-byte aligned: (4080, 576) has them (the last group's 16 columns still copied), (100, 64)'s rows of
    104 floats do not. Either way each row is the one it is computed alone (a small y, written as usual)."""
    panel = PanelLinear(fmt, _weight(shape), 1)
    x = _x(rows, shape[1])
    whole = _dot8(panel, x)
    assert whole.shape[0] * panel.panel_count * PANEL * 4 >= 1 << 20
    alone = torch.cat([_dot8(panel, x[r : r + 1]) for r in range(0, rows, 37)])
    assert torch.equal(whole[::37], alone)
    assert torch.equal(whole, _dot8(panel, x, reference=True))


def _gated(panel: PanelLinear, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    """dot8_rows.c's gated product called as `PanelLinear.gated` calls it, on `threads` threads."""
    lib, rows = library().lib, x.shape[0]
    y = torch.empty(rows, panel.out_features // 2)
    name = f"{panel.format}_{'dot16' if panel.rounding == 'int16' else 'dot8'}_gated"
    args = [x.contiguous().data_ptr(), rows, panel.in_features, panel.dot8.data_ptr(), panel.panel_count]
    assert getattr(lib, name)(*args, y.data_ptr(), y.shape[1], threads) == 0
    return y


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("ff", "rows"), [(1536, 1), (1536, 9), (1536, 300), (96, 70), (64, 2600)])
def test_a_gate_up_product_that_gates_its_own_sums_gives_the_product_then_the_gating_bit_for_bit(
    rounded, fmt, ff, rows
):
    """`PanelLinear.gated` (dot8_rows.c's `*_gated`) gates each group of the gate's sums and the up's beside it
    as the tiles make them: the product's bits, whatever rows share the call and however many threads take its
    items (one, two, eight: spans of rows), then the C gating's, the same function. Large inputs put the gate's
    sums where the exponential underflows and saturates."""
    panel = PanelLinear(fmt, torch.cat([_weight((ff, 576)), _weight((ff, 576), seed=3)]), 2)
    assert panel.gates
    for scale in (1.0, 300.0):
        x = _x(rows, 576) * scale
        y = panel.linear(x)
        want = c_silu_mul(y[:, :ff], y[:, ff:])
        assert scale == 1.0 or (y[:, :ff].abs() > 90).any()
        for threads in (1, 2, 8):
            assert torch.equal(_gated(panel, x, threads), want), threads
        assert torch.equal(panel.gated(x), want)
        for r in {0, rows // 2, rows - 1}:
            assert torch.equal(_gated(panel, x[r : r + 1]), want[r : r + 1]), r


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_product_over_no_rows_returns_no_rows(rounded, fmt):
    """Zero rows make zero items (the rows' spans once came out as 0 rows, and dividing by them killed the
    process with SIGFPE)."""
    panel = PanelLinear(fmt, _weight((128, 64)), 2)
    assert panel.linear(torch.empty(0, 64)).shape == (0, 128)
    assert panel.gated(torch.empty(0, 64)).shape == (0, 64)


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_gate_up_product_gates_only_in_whole_pairs_of_column_groups(rounded, fmt):
    """Each half must be a whole number of the tiles' 32-column groups for an item to pair the gate's group with
    the up's: 2 x 100 columns are not, so the weight does not gate (the layer gates after the product), and the
    kernel asked anyway computes nothing and says so."""
    panel = PanelLinear(fmt, _weight((200, 64)), 2)
    assert not panel.gates
    assert KernelProduct(panel, None).gating() is None
    with pytest.raises(ValueError, match="whole column groups"):
        panel.gated(_x(3, 64))
    whole = PanelLinear(fmt, _weight((128, 64)), 2)
    assert whole.gates and KernelProduct(whole, None).gating() is not None
    assert KernelProduct(whole, torch.zeros(128)).gating() is None  # a bias goes in before the gating


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("shape", "rows"), [((100, 64), 200), ((960, 576), 300)])
def test_a_long_prompts_rows_shared_out_in_spans_keep_the_references_bits_and_each_rows_own(rounded, fmt, shape, rows):
    """A prompt over few groups is shared out as (group, span of rows) items (dot8_rows.c's ROW_SPAN): with 8
    threads the 4 groups of (100, 64) take 4 spans of 64 rows, the 30 of (960, 576) 2 spans; with one thread
    each group takes every row. Each row is still its own chain: the reference's bits, alone or in the prompt."""
    panel = PanelLinear(fmt, _weight(shape), 1)
    x = _x(rows, shape[1])
    spread = _dot8(panel, x, threads=8)
    assert torch.equal(spread, _dot8(panel, x, reference=True))
    assert torch.equal(spread, _dot8(panel, x, threads=1))
    for r in (0, 63, 64, 130, rows - 1):  # either side of a span's edge, and the last
        assert torch.equal(spread[r : r + 1], _dot8(panel, x[r : r + 1])), r


@needs_vnni
def test_activations_are_int16_by_default_and_the_environment_picks_int8_or_float32(monkeypatch):
    w = _weight((96, 64))
    monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)
    panel = PanelLinear("q4_1", w, 1)
    assert (activations(), panel.rounding) == ("int16", "int16")
    assert panel.stored_bytes == panel.panels.numel() + panel.dot8.numel()  # both held
    assert PanelLinear("fp16", w, 1).dot8 is None  # only the block formats
    assert "int16 activations (float32's logits within 1e-7 nats" in resolve_weights("q4_1", CPU, torch.float32).label
    monkeypatch.setenv(ACTIVATIONS_ENV, "int8")
    assert PanelLinear("q4_1", w, 1).rounding == "int8"
    choice = resolve_weights("q4_1", CPU, torch.float32)
    assert "int8 activations" in choice.label and "not float32's logits" in choice.label
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    assert PanelLinear("q4_1", w, 1).dot8 is None  # gguf's float32 weights times float32 rows
    assert "activations" not in resolve_weights("q4_1", CPU, torch.float32).label
    monkeypatch.setenv(ACTIVATIONS_ENV, "int4")
    assert activations() == "int16"
    label = resolve_weights("q4_1", CPU, torch.float32).label
    assert f"{ACTIVATIONS_ENV}='int4' is none of int16, int8, float32" in label


@needs_kernel
def test_rounded_activations_asked_for_without_vnni_fall_back_saying_why(monkeypatch):
    from minengine.checkpoint import weight_format
    from minengine.fast import panel_kernels

    monkeypatch.setenv(ACTIVATIONS_ENV, "int8")
    monkeypatch.setattr(panel_kernels, "activations", lambda: "float32")
    monkeypatch.setattr(weight_format, "activations", lambda: "float32")
    choice = resolve_weights("q4_1", CPU, torch.float32)
    assert "float32 activations, since" in choice.label


@needs_vnni
@pytest.mark.parametrize(("total", "cut"), [(40, 24), (100, 37), (300, 256), (64, 17)])
def test_with_int8_activations_a_prompts_attention_is_the_same_bits_whatever_its_chunks(int8, total, cut):
    """SDPA cuts its queries into blocks by the chunk's length, so a position's output could differ in
    the last bits between a prompt taken whole and one cut in two (it does for these shapes); int8
    rounding would turn that into another token. Under int8 activations the prompt's attention is
    never SDPA: the key-blocked chunk kernel's rounded twin (as a q4_1 model is built)."""
    from minengine.config import ModelConfig
    from minengine.fast import chunk_attention
    from minengine.fast.row_ops import model_ops
    from minengine.steps.load import rounds_rows

    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=576, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
    cpu = torch.device("cpu")
    attend = model_ops(cpu, torch.float32, rounds_rows(cfg, cpu, "q4_1")).prompt_attention
    twin = chunk_attention.attend_chunk_rounded if chunk_attention.rounded(64) else chunk_attention.attend_chunk
    assert attend is twin
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 3, total, 64, generator=gen), torch.randn(1, 3, total, 64, generator=gen)
    q = torch.randn(1, 9, total, 64, generator=gen)
    whole = attend(q, k, v, 0, 0.125)
    first = attend(q[:, :, :cut].contiguous(), k[:, :, :cut], v[:, :, :cut], 0, 0.125)
    rest = attend(q[:, :, cut:].contiguous(), k, v, cut, 0.125)
    assert torch.equal(first, whole[:, :, :cut])
    assert torch.equal(rest, whole[:, :, cut:])
