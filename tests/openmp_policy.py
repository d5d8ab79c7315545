"""Undoing the OpenMP policy a run of `reqscope.cli.main` in this process chooses.

The command writes its choice into os.environ and `minengine.omp_env`; a test that runs it must
leave the next test (and the children it starts) the environment the suite started with. The
autouse fixture in conftest.py does this around every test; a module-scoped fixture that runs the
command is set up outside that fixture, so it calls this itself.
"""

from __future__ import annotations

import os

import pytest


def keep_openmp_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Have `monkeypatch` restore, on undo, the OpenMP variables and omp_env's choices as they are now."""
    from minengine import omp_env

    for name in (omp_env.VARIABLE, omp_env.SPIN_VARIABLE):
        before = os.environ.get(name)
        monkeypatch.setenv(name, "")  # records the value before, so undo restores (or removes) it
        if before is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, before)
    for attribute in ("_set_here", "_spin_here", "_start"):
        monkeypatch.setattr(omp_env, attribute, getattr(omp_env, attribute))
