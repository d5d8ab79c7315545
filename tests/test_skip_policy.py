"""The skip policy on pytest sessions of its own: in CI a skip fails the run unless its reason is allowed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from skip_policy import ALLOWED, ALLOWED_ON_CPUS_WITHOUT, Skip, allowed

TESTS = Path(__file__).resolve().parent

CONFTEST = """
from skip_policy import register

def pytest_configure(config):
    register(config)
"""


def _session(tmp_path: Path, body: str, ci: str | None) -> subprocess.CompletedProcess:
    """Run pytest on one test module `body` with the policy loaded, `CI` set to `ci` (or unset)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_case.py").write_text("import pytest\n\n" + body)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


SKIPPED_SERVER = """
def test_passes():
    pass

def test_live():
    pytest.skip("vLLM is not provisioned: run scripts/peers/vllm")
"""


def test_in_ci_a_skip_for_a_missing_server_fails_the_run_and_names_the_test(tmp_path):
    done = _session(tmp_path, SKIPPED_SERVER, ci="true")
    assert done.returncode == 1, done.stdout
    assert "skips CI does not allow" in done.stdout
    assert "test_case.py::test_live: vLLM is not provisioned: run scripts/peers/vllm" in done.stdout


def test_outside_ci_the_same_skip_passes_and_is_listed_with_its_reason(tmp_path):
    for ci in (None, "", "0", "false"):
        done = _session(tmp_path, SKIPPED_SERVER, ci=ci)
        assert done.returncode == 0, (ci, done.stdout)
        assert "SKIPPED [1] test_case.py:" in done.stdout and "vLLM is not provisioned" in done.stdout


def test_a_module_level_skip_counts_as_a_skip(tmp_path):
    body = 'pytest.skip("llama-server or the default GGUF not provisioned", allow_module_level=True)\n'
    done = _session(tmp_path, body, ci="1")
    assert done.returncode == 1, done.stdout
    assert "llama-server or the default GGUF not provisioned" in done.stdout


def test_in_ci_every_allowed_reason_passes(tmp_path):
    tests = "".join(
        f"@pytest.mark.skipif(True, reason={a.reason!r})\ndef test_{i}():\n    pass\n\n" for i, a in enumerate(ALLOWED)
    )
    done = _session(tmp_path, tests + "def test_runs():\n    pass\n", ci="true")
    assert done.returncode == 0, done.stdout
    assert f"1 passed, {len(ALLOWED)} skipped" in done.stdout


def test_an_xfail_is_not_a_skip_and_a_failure_keeps_its_exit_code(tmp_path):
    body = """
def test_expected():
    pytest.xfail("known")

def test_fails():
    assert False

def test_live():
    pytest.skip("chromium is not installed")
"""
    done = _session(tmp_path, body, ci="true")
    assert done.returncode == 1, done.stdout
    refused = done.stdout.split("skips CI does not allow", 1)[1]
    assert "test_live" in refused and "test_expected" not in refused


def test_a_skip_for_a_cpu_feature_is_allowed_only_on_a_cpu_without_it():
    # A Zen 3 (AVX2 only) cannot run the VNNI tiles' tests; a VNNI CPU whose tests skip failed to build them.
    zen3, zen4 = frozenset({"avx2", "fma"}), frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"})
    for entry in ALLOWED_ON_CPUS_WITHOUT:
        skip = Skip("tests/engine/test_x.py::test_y", entry.reason + " (and what else the test says)")
        assert allowed(skip, zen3) == entry
        assert allowed(skip, zen4) is None
        assert allowed(skip, zen4 - {entry.flag}) == entry
    assert allowed(Skip("t", "vLLM is not provisioned: run scripts/peers/vllm"), zen3) is None
