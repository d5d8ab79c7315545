"""Where an export from the explorer goes: a new folder per run, never an existing one."""

from __future__ import annotations

from pathlib import Path

DEFAULT_ROOT = Path("reqscope-runs")


def claim_run_folder(root: Path, name: str) -> Path:
    """Create and return `root/name`, or `root/name-2`, `-3`... if taken (never overwrites)."""
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = root / (name if n == 1 else f"{name}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            n += 1
            continue
        return folder
