"""Paging out a tensor's memory (`page_out`): a mapped file's pages leave the resident set and read back
the same; the process's own memory keeps every byte; a warm load pages out the groups it copied."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minengine.model.page_out import page_out

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT) is Linux's")


def _resident_kib(address: int) -> int:
    """The resident KiB of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@linux
def test_a_mapped_files_pages_leave_the_resident_set_and_read_back_the_same(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"t": torch.arange(4 << 20, dtype=torch.int32)}, str(path))  # 16 MiB
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        t = handle.get_tensor("t")
    assert int(t.sum()) == (4 << 20) * ((4 << 20) - 1) // 2  # every page read in
    before = _resident_kib(t.data_ptr())
    assert before > 15 << 10
    assert page_out(t)
    assert _resident_kib(t.data_ptr()) < before // 4
    assert torch.equal(t, torch.arange(4 << 20, dtype=torch.int32))  # faulted back in from the file


@linux
def test_the_processs_own_memory_keeps_every_byte():
    t = torch.randn(1 << 20)
    kept = t.clone()
    page_out(t)  # without swap the kernel keeps it; with swap it comes back on reading
    assert torch.equal(t, kept)
    assert not page_out(t[:100])  # less than a whole page: nothing to advise


@linux
def test_a_warm_load_pages_out_the_groups_it_copied(monkeypatch):
    from minengine.model import panel_kernels
    from minengine.model.panel_kernels import ACTIVATIONS_ENV, PanelLinear, activations

    monkeypatch.setenv(ACTIVATIONS_ENV, "int16")
    if panel_kernels.library().lib is None or activations() != "int16":
        pytest.skip("rounded activations need AVX-512 VNNI")
    paged = []
    monkeypatch.setattr(panel_kernels, "page_out", lambda t: paged.append(t) or True)
    made = PanelLinear("q4_1", torch.randn(96, 64) * 0.02, 1)
    assert paged == []  # built here: the groups are the process's own, and a layout file is written from them
    again = PanelLinear.stored("q4_1", made.panels, 96, 1)
    assert paged == [made.panels] and torch.equal(again.dot8, made.dot8)
    monkeypatch.setenv(ACTIVATIONS_ENV, "float32")
    PanelLinear.stored("q4_1", made.panels, 96, 1)
    assert len(paged) == 1  # float32 rows read the groups every step
