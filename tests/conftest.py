"""Shared fixtures: tiny random models of each family, and the real default model."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from minengine import settings

# tests/engine/test_other_builds.py runs modules again as on a CPU without these /proc/cpuinfo flags (a
# comma-separated list): the kernels are then built, and every probe answers, as they would there.
if os.environ.get("REQSCOPE_TEST_CPU_WITHOUT"):
    _lacking, _flags = frozenset(os.environ["REQSCOPE_TEST_CPU_WITHOUT"].split(",")), settings.cpu_flags
    settings.cpu_flags = lambda: _flags() - _lacking  # before anything reads them

sys.path.insert(0, str(Path(__file__).parent))

from openmp_policy import keep_openmp_policy  # noqa: E402
from skip_policy import register as register_skip_policy  # noqa: E402
from tiny_models import SPECS, build_tiny  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def pytest_configure(config):
    """In CI, a skip for a reason CI could do something about fails the run (tests/skip_policy.py)."""
    register_skip_policy(config)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (folder, transformers model) for every tiny spec."""
    root = tmp_path_factory.mktemp("tiny")
    return {spec.name: (root / spec.name, build_tiny(spec, root / spec.name)) for spec in SPECS}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (pulled on first use)."""
    from minengine.hub.pull import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    """The real default model loaded in float32 on the CPU."""
    from minengine.engine.engine import Engine

    return Engine(default_model_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=1 << 30)


@pytest.fixture(scope="session")
def chatty_tiny_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random llama with the default model's real tokenizer and chat template.

    Fast engine-level tests (stop strings, cancellation, admission) run on it.
    """
    from tiny_models import TinySpec

    folder = tmp_path_factory.mktemp("chatty")
    spec = TinySpec("chatty", "llama", {"vocab_size": 49152, "eos_token_id": 2, "max_position_embeddings": 2048})
    build_tiny(spec, folder)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def chatty_engine(chatty_tiny_dir):
    """Engine over the chatty tiny model (CPU, float32, 64 MiB KV budget)."""
    from minengine.engine.engine import Engine

    return Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", kv_budget_bytes=64 << 20)


@pytest.fixture(autouse=True)
def _openmp_policy_restored(monkeypatch):
    """Tests that call `reqscope.cli.main` in this process let it choose an OpenMP policy, which
    it writes into os.environ and minengine.omp_env; undo that after each test, so the next one
    (and the children it starts) sees the environment the suite started with."""
    keep_openmp_policy(monkeypatch)


@pytest.fixture(autouse=True)
def read_ceiling_file(tmp_path_factory, monkeypatch) -> Path:
    """Where this test's runs read (and `reqscope calibrate` keeps) the machine's read ceiling: a
    folder of its own, never the user's home, so no run's roofline depends on what was measured
    before it."""
    from reqscope.bench import ceiling

    path = tmp_path_factory.mktemp("ceiling") / ceiling.CEILING_FILE
    monkeypatch.setattr(ceiling, "ceiling_path", lambda: path)
    return path
