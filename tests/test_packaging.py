"""What a wheel or a plain `pip install .` carries: every package folder, under its installed name.

pyproject.toml lists the packages by hand (its folders install under other names: app/ as
reqscope, models/ as reqscope.cards), so a new folder left off the list installs nowhere, while
the editable install that scripts/setup makes still finds it. `reqscope.endpoint.server` was once
left off that way; this test fails for the next one.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    found = set()
    for folder, name in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in relative.parts:
                continue
            found.add(".".join((name, *relative.parts)))
    listed = set(setuptools["packages"])
    assert found - listed == set(), "package folders pyproject.toml does not list"
    assert listed - found == set(), "packages pyproject.toml lists that have no folder"
