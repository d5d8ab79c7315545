"""AMX's tiles under the int16 products (amx_rows.c): the VNNI tiles' bits and the plain C reference's, at
every row count from 16 (where the tiles take over) through several 64-row calls, for q4_1 and q8_0
blocks, in one call and inside the C stack's one region; and the setting that says whether they run."""

from __future__ import annotations

import pytest
import torch

from minengine import settings
from minengine.config import ModelConfig
from minengine.fast.cpu_kernels import library
from minengine.fast.panel_kernels import ACTIVATIONS_ENV, PANEL, PanelLinear, amx_setting
from minengine.fast.row_ops import c_silu_mul
from minengine.kv.block_pool import BlockPool
from minengine.kv.paged_cache import PagedKVCache
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row

CPU = torch.device("cpu")

needs_tiles = pytest.mark.skipif(
    library().lib is None or not library().lib.amx_ready(), reason="no AMX tiles granted on this CPU"
)
SHAPES = [(960, 576), (576, 1536), (100, 64)]  # whole groups, and a partial last group
# Either side of the threshold and of a 64-row call; 300 rows of the widest shape make a y of over 1 MiB,
# which the tiles write around the caches (amx_rows.h's AMX_STREAM_BYTES).
ROWS = (15, 16, 17, 31, 32, 33, 64, 65, 100, 130, 300)


@pytest.fixture
def int16(monkeypatch):
    monkeypatch.setenv(ACTIVATIONS_ENV, "int16")


def _x(rows: int, features: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 30  # an outlier channel: a block's scale follows it, so its other values round small
    return x


def _products(
    panel: PanelLinear, x: torch.Tensor, *, tiles: bool, reference: bool = False, threads: int = 2
) -> torch.Tensor:
    lib = library().lib
    y = torch.empty(x.shape[0], panel.panel_count * PANEL)
    args = [x.contiguous().data_ptr(), x.shape[0], panel.in_features, panel.dot8.data_ptr(), panel.panel_count]
    lib.amx_use(int(tiles))
    try:
        if reference:
            getattr(lib, f"{panel.format}_dot16_reference")(*args, y.data_ptr(), y.shape[1])
        else:
            getattr(lib, f"{panel.format}_dot16")(*args, y.data_ptr(), y.shape[1], threads)
    finally:
        lib.amx_use(1)
    return y[:, : panel.out_features]


@needs_tiles
@pytest.mark.parametrize("fmt", ("q4_1", "q8_0"))
@pytest.mark.parametrize("shape", SHAPES)
def test_the_tiles_give_the_vnni_tiles_bits_and_the_references(int16, fmt, shape):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.02
    panel = PanelLinear(fmt, weight, 1)
    assert panel.rounding == "int16"
    for rows in ROWS:
        x = _x(rows, shape[1], seed=rows)
        tiles = _products(panel, x, tiles=True)
        assert torch.equal(tiles, _products(panel, x, tiles=False)), rows
        if rows in (16, 33):
            assert torch.equal(tiles, _products(panel, x, tiles=False, reference=True)), rows
        if rows >= 130:  # more threads than the groups serve: each group's rows in spans of 64, on the tiles
            assert torch.equal(tiles, _products(panel, x, tiles=True, threads=7)), rows


@needs_tiles
@pytest.mark.parametrize("fmt", ("q4_1", "q8_0"))
def test_a_gate_up_product_gating_its_own_sums_on_the_tiles_gives_the_vnni_tiles_bits(int16, fmt):
    """dot8_rows.c's `*_gated` takes the tiles from 16 rows too, AMX_MAX_ROWS rows of the gate's group and the up's
    at a time into its scratch: the same bits as without the tiles, and as the product then the C gating."""
    ff, lib = 1536, library().lib
    weight = torch.randn(2 * ff, 576, generator=torch.Generator().manual_seed(0)) * 0.02
    panel = PanelLinear(fmt, weight, 2)
    assert panel.gates
    for rows in (15, 16, 65, 300):
        x = _x(rows, 576, seed=rows)
        y = _products(panel, x, tiles=True)
        want = c_silu_mul(y[:, :ff], y[:, ff:])
        got = {}
        for tiles in (True, False):
            lib.amx_use(int(tiles))
            try:
                got[tiles] = panel.gated(x)
            finally:
                lib.amx_use(1)
        assert torch.equal(got[True], want) and torch.equal(got[False], want), rows


@needs_tiles
def test_a_shared_step_through_the_c_stack_gives_the_same_logits_with_and_without_the_tiles(tiny_models, int16):
    """32 decode rows in one C-stack call (decode_layers.c's one region, each row split as it is rounded)."""
    folder, _ = tiny_models["llama-gqa"]
    cfg = ModelConfig.from_file(folder)
    runner = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs="q4_1"), static_decode=False)
    pool, lib = BlockPool(64 << 20, CPU), library().lib
    caches = []
    for i in range(32):
        cache = PagedKVCache(pool, cfg, owner=f"row {i}", device=CPU, compute_dtype=torch.float32, expect_tokens=8)
        runner.forward(torch.tensor([3 + i, 7, 11 + i]), 0, cache)
        caches.append(cache)
    outs = {}
    for tiles in (True, False):
        lib.amx_use(int(tiles))
        try:
            outs[tiles] = torch.stack(runner.forward_rows([Row((5 + i,), 3, caches[i], True) for i in range(32)]))
            assert runner.last_path.name == "c-stack rows int16×q4_1"
            assert ("on AMX tiles" in runner.last_path.why) == tiles  # the step says which ran
        finally:
            lib.amx_use(1)
    assert torch.equal(outs[True], outs[False])  # both wrote position 3 of each cache, the same K/V


@needs_tiles
def test_a_prompt_gives_the_same_logits_with_and_without_the_tiles(tiny_models, int16):
    """A 150-token prompt through the Python blocks: every product and the gated MLP in three 64-row windows,
    the last one short, then a decode step over the cache it wrote."""
    folder, _ = tiny_models["llama-gqa"]
    cfg = ModelConfig.from_file(folder)
    runner = ModelRunner(load_model(folder, cfg, torch.float32, CPU, packs="q4_1"), static_decode=False)
    pool, lib = BlockPool(64 << 20, CPU), library().lib
    ids = torch.arange(150) * 7 % cfg.vocab_size
    outs = {}
    for tiles in (True, False):
        lib.amx_use(int(tiles))
        try:
            cache = PagedKVCache(pool, cfg, owner=f"tiles {tiles}", device=CPU, compute_dtype=torch.float32)
            prompt = runner.forward(ids, 0, cache, all_logits=True)
            outs[tiles] = (prompt, runner.forward(torch.tensor([9]), 150, cache))
        finally:
            lib.amx_use(1)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])


def test_the_setting_says_whether_the_tiles_run_and_the_environment_turns_them_off(monkeypatch):
    monkeypatch.setenv(settings.AMX_ENV, "off")
    off = amx_setting()
    assert (off.value, off.source) == ("off", settings.ENVIRONMENT) and settings.AMX_ENV in off.detail
    monkeypatch.delenv(settings.AMX_ENV)
    found = amx_setting()
    lib = library().lib
    if lib is not None and lib.amx_emulated():  # built as REQSCOPE_AMX=emulate asked, whatever it says now
        assert (found.value, found.source) == ("emulated", settings.ENVIRONMENT) and "in C" in found.detail
    elif lib is not None and lib.amx_ready():
        assert (found.value, found.source) == ("on", settings.PROBE)
    else:
        assert found.value == "off" and found.detail  # says why: no tiles built, granted or no int16
