"""Fixtures every serving test module shares: its own engine over the chatty tiny model, and a server on it."""

from __future__ import annotations

import pytest
from serve_harness import serving

from minengine.engine.engine import Engine


@pytest.fixture(scope="module")
def engine(chatty_tiny_dir):
    """An engine of the module's own, so no module sees another's prefix cache or queue."""
    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)


@pytest.fixture(scope="module")
def served(engine):
    """`reqscope serve` on that engine with the harness's defaults (a module needing others overrides it)."""
    with serving(engine) as s:
        yield s
