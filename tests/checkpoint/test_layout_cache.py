"""The cached CPU weight layout: mapped back bit for bit, rebuilt when stale, optional."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tiny_models import SPECS

from minengine.checkpoint import layout_cache
from minengine.config import ModelConfig
from minengine.kv.cache import KVCache
from minengine.steps.load import load_model

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _cache_every_folder(monkeypatch):
    """These tests load copies in tmp folders, which by default get no cache: ask for one."""
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")


def _copy(tiny_models, name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(tiny_models[name][0], folder, ignore=shutil.ignore_patterns(layout_cache.CACHE_DIR))
    return folder


def _load(folder):
    cfg = ModelConfig.from_file(folder)
    return cfg, load_model(folder, cfg, torch.float32, CPU)


def _layouts(folder):
    return sorted((folder / layout_cache.CACHE_DIR).glob("layout-*.safetensors"))


def _logits(model, cfg):
    cache = KVCache(cfg, 16, device=CPU, compute_dtype=torch.float32)
    ids = torch.arange(3, 11)
    prefill = model.forward(ids, 0, cache)
    return prefill, model.forward(torch.tensor([5]), ids.shape[0], cache)


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_mapped_layout_equals_the_built_one(tiny_models, name, tmp_path):
    folder = _copy(tiny_models, name, tmp_path)
    cfg, built = _load(folder)
    assert len(_layouts(folder)) == 1
    _, mapped = _load(folder)
    ours, theirs = built.layers[0].tensors() + [built.lm_head], mapped.layers[0].tensors() + [mapped.lm_head]
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
        assert b.data_ptr() % layout_cache.ALIGN == 0  # BLAS may round differently on other alignments
    for a, b in zip(_logits(built, cfg), _logits(mapped, cfg), strict=True):
        assert torch.equal(a, b)
    assert mapped.weight_bytes == built.weight_bytes


def test_a_changed_checkpoint_gets_a_new_layout(tiny_models, tmp_path):
    folder = _copy(tiny_models, "llama-gqa", tmp_path)
    _load(folder)
    (first,) = _layouts(folder)
    weights = folder / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _load(folder)
    (second,) = _layouts(folder)  # the stale one is replaced, not kept beside it
    assert second != first


def test_an_unreadable_layout_is_rebuilt(tiny_models, tmp_path):
    folder = _copy(tiny_models, "llama-gqa", tmp_path)
    cfg, built = _load(folder)
    (path,) = _layouts(folder)
    path.write_bytes(b"not a safetensors file")
    _, again = _load(folder)
    assert torch.equal(_logits(built, cfg)[0], _logits(again, cfg)[0])
    assert path.stat().st_size > 100


def test_the_cache_can_be_turned_off(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "0")
    folder = _copy(tiny_models, "llama-gqa", tmp_path)
    _load(folder)
    assert _layouts(folder) == []


def test_a_folder_that_cannot_be_written_still_loads(tiny_models, tmp_path, monkeypatch):
    folder = _copy(tiny_models, "llama-gqa", tmp_path)
    monkeypatch.setattr(layout_cache.tempfile, "mkstemp", _refuse)
    cfg, model = _load(folder)
    assert _layouts(folder) == []
    cache = KVCache(cfg, 8, device=CPU, compute_dtype=torch.float32)
    assert model.forward(torch.arange(3, 8), 0, cache).isfinite().all()


def _refuse(*args, **kwargs):
    raise PermissionError("read-only folder")


def test_by_default_only_pulled_models_get_a_cache(tiny_models, tmp_path, monkeypatch):
    monkeypatch.delenv(layout_cache.DISABLE_ENV)
    monkeypatch.setenv("REQSCOPE_HOME", str(tmp_path / "home"))
    brought = _copy(tiny_models, "llama-gqa", tmp_path)  # a folder the user passed with --model
    _load(brought)
    assert _layouts(brought) == []  # as large as the weights: not written into the user's folder
    (tmp_path / "home").mkdir()
    pulled = _copy(tiny_models, "llama-gqa", tmp_path / "home")
    _load(pulled)
    assert len(_layouts(pulled)) == 1


@pytest.mark.parametrize("activations", ["int16", "float32"])
def test_a_warm_load_hands_back_the_groups_its_dot8_copy_replaces(tiny_models, tmp_path, monkeypatch, activations):
    from minengine.checkpoint.mapped_pages import MappedFiles
    from minengine.fast.panel_kernels import ACTIVATIONS_ENV
    from minengine.fast.panel_kernels import activations as active

    monkeypatch.setenv(ACTIVATIONS_ENV, activations)
    if active() != activations:
        pytest.skip("int16 activations need AVX-512 VNNI and the panel kernel")
    released, release = set(), MappedFiles.release  # the pages of every tensor released, by address
    monkeypatch.setattr(MappedFiles, "release", lambda self, t: released.add(t.data_ptr()) or release(self, t))
    folder = _copy(tiny_models, "llama-mha-tied", tmp_path)
    cfg = ModelConfig.from_file(folder)
    built = load_model(folder, cfg, torch.float32, CPU, packs="q4_1")
    mapped = load_model(folder, cfg, torch.float32, CPU, packs="q4_1")

    def groups(model):
        layers = [t for layer in model.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return {p.panels.data_ptr() for p in [model.lm_head, *layers]}

    assert not groups(built) & released  # built here: the process's own memory, and the layout is written from it
    if activations == "int16":  # every projection multiplies its copy: its groups go back to the file
        assert groups(mapped) <= released
    else:
        assert not groups(mapped) & released  # float32 rows read the groups every step
    for a, b in zip(_logits(built, cfg), _logits(mapped, cfg), strict=True):
        assert torch.equal(a, b)  # the tied head's lookups read its released groups back from the file
