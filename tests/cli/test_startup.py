"""Start-up: the OpenMP wait policy is chosen before torch loads, and the plain path imports little."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minengine import omp_env
from reqscope.bench.start import PlainRun, plain_imports


@pytest.fixture
def fresh_policy(monkeypatch):
    monkeypatch.delenv(omp_env.VARIABLE, raising=False)
    monkeypatch.setattr(omp_env, "_set_here", False)


def test_passive_unless_the_environment_chose(fresh_policy, monkeypatch):
    omp_env.prefer_passive_wait()
    assert os.environ[omp_env.VARIABLE] == "PASSIVE" and omp_env.set_here()
    monkeypatch.setenv(omp_env.VARIABLE, "ACTIVE")
    monkeypatch.setattr(omp_env, "_set_here", False)
    omp_env.prefer_passive_wait()
    assert os.environ[omp_env.VARIABLE] == "ACTIVE" and not omp_env.set_here()


def test_the_command_sets_the_policy_before_loading_torch():
    env = {k: v for k, v in os.environ.items() if k != omp_env.VARIABLE}
    code = (
        "import sys; from reqscope import cli; "
        "sys.argv = ['reqscope', 'plan', '--help']\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "PASSIVE", done.stderr


def test_plain_path_skips_modules_it_does_not_need(chatty_tiny_dir):
    modules = plain_imports(PlainRun("hello", 2, chatty_tiny_dir, "cpu", "float32"))
    assert "torch" in modules and "minengine" in modules  # the listing works
    for unneeded in ("textual", "transformers", "gguf", "psutil"):
        assert unneeded not in modules


def test_the_collector_is_back_on_after_the_verb_is_imported():
    code = (
        "import gc\nfrom reqscope import cli\n"
        "try:\n    cli.main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "True True", done.stderr
