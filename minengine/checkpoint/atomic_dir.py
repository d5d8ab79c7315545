"""Build a folder under a hidden temporary name and move it into place only once it is complete.

A model folder that exists is assumed to load. Writing straight into the final path would break
that promise whenever a write is interrupted (Ctrl-C, full disk, crash), so every writer stages
next to the target, on the same filesystem, where a rename is atomic.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


def is_empty_or_missing(path: Path) -> bool:
    """True when `path` does not exist or is an empty directory."""
    if not path.exists():
        return True
    return path.is_dir() and not any(path.iterdir())


@contextlib.contextmanager
def staged_dir(target: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh hidden folder beside `target`; rename it to `target` when the block succeeds.

    On any exception (KeyboardInterrupt included) the staging folder is deleted and `target` is
    left as it was. With `replace`, an existing `target` is swapped out and deleted; without it,
    only a missing or empty `target` may be filled, and anything else raises FileExistsError.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        yield stage
        _apply_umask(stage)
        publish_dir(stage, target, replace=replace)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def publish_dir(source: Path, target: Path, *, replace: bool) -> None:
    """Move the finished folder `source` to `target` (same filesystem), see `staged_dir`."""
    if not replace or is_empty_or_missing(target):
        try:
            # rename(2) also replaces an empty directory, which keeps an empty OUT_DIR usable.
            os.replace(source, target)
        except OSError as exc:
            if target.exists() and not is_empty_or_missing(target):
                raise FileExistsError(f"{target} already exists and is not empty") from exc
            raise
        return
    retired = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(target, retired)
    try:
        os.replace(source, target)
    except BaseException:
        os.replace(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def _apply_umask(folder: Path) -> None:
    # mkdtemp (and safetensors' own temp files) are private (0700/0600); the published folder
    # should get the permissions any ordinary folder of this user gets.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
