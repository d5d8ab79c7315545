"""The package list, found rather than written: setuptools' own `packages.find` names a package by its
folder, and two of ours install under other names (app/ as reqscope, models/ as reqscope.cards), so
pyproject.toml cannot say this. Every folder with an `__init__.py` under those three is a package;
tests/test_packaging.py checks that a built wheel carries every tracked file under them."""

from setuptools import find_packages, setup

# Installed name -> folder. pyproject.toml's [tool.setuptools] package-dir says the same.
FOLDERS = {"reqscope": "app", "reqscope.cards": "models", "minengine": "minengine"}


def discovered() -> list[str]:
    """Every package under FOLDERS, by its installed name."""
    names = set(FOLDERS)
    for name, folder in FOLDERS.items():
        names.update(f"{name}.{sub}" for sub in find_packages(folder))
    return sorted(names)


setup(packages=discovered())
