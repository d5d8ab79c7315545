"""What a wheel or a plain `pip install .` carries: every file of every package folder, under its installed name.

The folders install under other names (app/ as reqscope, models/ as reqscope.cards), and setup.py finds
the packages under them. A folder it does not find, or a data file no package-data pattern takes,
installs nowhere, while the editable install that scripts/setup makes still finds it from the tree
(`reqscope.endpoint.server` was once left out that way). These tests build a real wheel from a copy
of the tree and compare its files with the tree's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")


def _folders() -> dict[str, str]:
    """Folder -> installed name, from pyproject.toml's package-dir."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {folder: name for name, folder in package_dir.items()}


def _source_files(folder: str) -> list[Path]:
    """The files under a package folder, less Python's byte-code caches."""
    return [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def _installed_path(folder: str, path: Path) -> str:
    """Where a file of `folder` lands in the wheel: its folder replaced by the installed name's path."""
    name = _folders()[folder]
    return "/".join((*name.split("."), *path.relative_to(ROOT / folder).parts))


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    """The file names inside a wheel built from a copy of the package folders and build files (a copy,
    so that no stale build/ folder of the tree's can add or keep anything)."""
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, source / name)
    for folder in _folders():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."]
    done = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("reqscope-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def test_every_folder_with_python_in_it_is_a_package():
    """setup.py finds packages by their `__init__.py`; a folder of modules without one would be left out."""
    missing = sorted(
        str(d.relative_to(ROOT))
        for folder in _folders()
        for d in {p.parent for p in (ROOT / folder).rglob("*.py")}
        if "__pycache__" not in d.parts and not (d / "__init__.py").exists()
    )
    assert missing == [], "folders of modules without an __init__.py (the wheel would leave them out)"


def test_the_wheel_carries_every_file_of_every_package_folder(wheel_files):
    tree = {_installed_path(folder, p) for folder in _folders() for p in _source_files(folder)}
    assert tree - wheel_files == set(), "files of the tree a wheel leaves out"
    assert wheel_files - tree == set(), "files in the wheel that the tree does not have"


def test_the_wheel_carries_the_endpoint_server_views_and_the_kernels_sources(wheel_files):
    """The two that a hand-written list once missed or could miss: a subpackage and non-Python data."""
    assert "reqscope/endpoint/server/__init__.py" in wheel_files
    assert "minengine/fast/panel_rows.c" in wheel_files
    assert "reqscope/ui/explorer.tcss" in wheel_files
    assert "reqscope/cards/smollm2-135m-instruct.json" in wheel_files
