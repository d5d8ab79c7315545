"""The fair comparison: engines in their own processes, timed through pipes, each in its users' environment.

Nothing here times anything against a target: the figures are only checked for being there and
being measured the way the benchmark says.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minengine import omp_env
from minengine.errors import ReqscopeError
from reqscope.bench.fair.compare import REQSCOPE, TRANSFORMERS, Contender, run_fair
from reqscope.bench.fair.peers import (
    LLAMA_CPP,
    PeerChoice,
    PeerPlan,
    gguf_read_bytes,
    llama_child_argv,
    llama_cpp_installed,
    select_peers,
)
from reqscope.bench.fair.pipes import stream_run
from reqscope.bench.report import format_fair
from reqscope.bench.schedule import BenchConfig, fair_contenders

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# A stand-in engine: an environment line, then `n` tokens `gap` seconds apart, then done.
FAKE_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    n, gap = int(sys.argv[1]), float(sys.argv[2])
    def emit(**r):
        sys.stdout.write(json.dumps(r) + "\\n"); sys.stdout.flush()
    emit(event="environment", omp_wait_policy=os.environ.get("OMP_WAIT_POLICY") or "not set", threads=1,
         libraries="fake 1.0")
    for i in range(n):
        time.sleep(gap)
        emit(event="token", token_id=100 + i)
    emit(event="done", first_token_ms=5.0, prompt_tokens=7)
    """
)


def _fake(name: str, n: int, gap: float, env: dict[str, str] | None = None) -> Contender:
    argv = (sys.executable, "-c", FAKE_CHILD, str(n), str(gap))
    return Contender(name, f"fake {name}", argv, env or dict(os.environ))


@pytest.fixture
def policy_set_by_reqscope(monkeypatch):
    """This process as `reqscope` leaves it: OMP_WAIT_POLICY=PASSIVE, chosen by itself."""
    monkeypatch.setenv(omp_env.VARIABLE, "PASSIVE")
    monkeypatch.setattr(omp_env, "_set_here", True)


# -- the harness with stand-in children --------------------------------------------------------------


def test_rates_come_from_arrival_times_first_token_excluded():
    run = stream_run("fake", _fake("fake", 5, 0.05).argv, dict(os.environ))
    assert run.tokens == (100, 101, 102, 103, 104)
    assert len(run.arrival_s) == 5 and list(run.arrival_s) == sorted(run.arrival_s)
    # The rate is the 4 gaps after the first token as they arrived here, whatever the child says.
    window = run.arrival_s[-1] - run.arrival_s[0]
    assert run.decode_tokens_per_s == pytest.approx(4 / window)
    # The child sleeps 50 ms before each token, so the window is near 200 ms; only the first token
    # arriving late can shorten it (CI once saw 20.51 tok/s), never down to a child-reported rate.
    assert 0 < run.decode_tokens_per_s < 30
    assert run.first_token_ms == 5.0 and run.prompt_tokens == 7
    assert run.environment is not None and run.environment.libraries == "fake 1.0"


def test_a_failing_child_is_a_one_line_error():
    argv = (sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    with pytest.raises(ReqscopeError) as err:
        stream_run("peer x", argv, dict(os.environ))
    assert str(err.value) == "peer x exited with 3: boom"
    error_event = 'import json; print(json.dumps({"event": "error", "message": "no model here"}))'
    with pytest.raises(ReqscopeError, match="^peer y: no model here$"):
        stream_run("peer y", (sys.executable, "-c", error_event), dict(os.environ))


def test_a_fake_peer_sits_beside_both_sides_with_per_round_ratios():
    sides = [_fake(REQSCOPE, 5, 0.02), _fake(TRANSFORMERS, 5, 0.04), _fake("fake-peer", 5, 0.01)]
    fair = run_fair(sides, rounds=2, new_tokens=5, skipped=("other: skipped, not installed",))
    assert [s.name for s in fair.sides] == [REQSCOPE, TRANSFORMERS, "fake-peer"]
    assert fair.side(TRANSFORMERS).vs_transformers.median == 1.0
    assert fair.decode_speedup.n == 2 and fair.decode_speedup.median > 1.0  # 20 ms gaps against 40
    assert fair.parity.identical and fair.parity.tokens == 5
    text = "\n".join(format_fair(fair))
    assert "fake-peer" in text and "peer other: skipped, not installed" in text
    assert "OMP_WAIT_POLICY" in text and "fake 1.0" in text


# -- both real sides on a tiny model ------------------------------------------------------------------


def test_both_sides_measured_through_pipes_each_in_its_users_environment(chatty_tiny_dir, policy_set_by_reqscope):
    from reqscope.bench.fair.peers import PeerSelection
    from reqscope.bench.schedule import _engine

    config = BenchConfig(model_dir=chatty_tiny_dir, device="cpu", dtype="float32", rounds=1, new_tokens=5)
    contenders = fair_contenders(config, _engine(config), PeerSelection((), ()))
    by_name = {c.name: c for c in contenders}
    assert set(by_name) == {REQSCOPE, TRANSFORMERS}
    # Neither child inherits the policy this process chose for itself.
    assert all(omp_env.VARIABLE not in c.env for c in contenders)
    fair = run_fair(contenders, rounds=1, new_tokens=5)
    ours, theirs = fair.side(REQSCOPE), fair.side(TRANSFORMERS)
    assert ours.tokens == theirs.tokens == 5 and fair.parity.identical
    assert ours.decode_tokens_per_s.median > 0 and theirs.decode_tokens_per_s.median > 0
    assert ours.first_token_ms is not None and theirs.first_token_ms is not None
    # The transformers child saw the user's environment: no policy at all, as the user had it.
    assert theirs.environment.omp_wait_policy == "not set"
    assert "transformers" in theirs.environment.libraries and "torch" in theirs.environment.libraries
    # reqscope chose its own, as the command does: spinning while it decodes where it can watch the
    # machine, else sleeping workers.
    spins = omp_env.sample_machine() is not None
    expected = f"not set, {omp_env.SPIN_VARIABLE}={omp_env.SPIN_COUNT}" if spins else "PASSIVE"
    assert ours.environment.omp_wait_policy.startswith(f"{expected} (reqscope's default")
    text = "\n".join(format_fair(fair))
    assert "OMP_WAIT_POLICY not set, " in text and f"OMP_WAIT_POLICY {expected} (reqscope's default" in text


def test_a_policy_the_user_set_is_handed_on(monkeypatch):
    monkeypatch.setenv(omp_env.VARIABLE, "ACTIVE")
    monkeypatch.setattr(omp_env, "_set_here", False)
    assert omp_env.user_environment()[omp_env.VARIABLE] == "ACTIVE"
    monkeypatch.setattr(omp_env, "_set_here", True)
    assert omp_env.VARIABLE not in omp_env.user_environment()
    assert omp_env.describe({}) == "not set" and omp_env.describe({omp_env.VARIABLE: "PASSIVE"}) == "PASSIVE"


# -- peers -------------------------------------------------------------------------------------------


def test_llama_cpp_is_skipped_with_a_line_when_missing(tmp_path):
    selection = select_peers(PeerChoice(), tmp_path, installed=lambda: False)
    assert selection.plans == ()
    (line,) = selection.skipped
    assert line.startswith(f"{LLAMA_CPP}: skipped") and "llama_cpp" in line and "pip install -e '.[peers]'" in line
    assert select_peers(PeerChoice(names=()), tmp_path, installed=lambda: False).skipped == ()
    with pytest.raises(ReqscopeError, match="not installed"):
        select_peers(PeerChoice(names=(LLAMA_CPP,)), tmp_path, installed=lambda: False)


def test_llama_cpp_without_a_gguf_for_the_model_is_skipped_or_refused(tmp_path):
    selection = select_peers(PeerChoice(), tmp_path, installed=lambda: True)
    assert selection.plans == () and "--peer-gguf" in selection.skipped[0]
    with pytest.raises(ReqscopeError, match="no such file"):
        select_peers(PeerChoice(gguf=tmp_path / "missing.gguf"), tmp_path, installed=lambda: True)


def test_unknown_peer_is_an_error():
    with pytest.raises(ReqscopeError, match="unknown peer 'vllm'; known peers: llama.cpp"):
        select_peers(PeerChoice(names=("vllm",)), Path("."), installed=lambda: True)


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "reqscope.bench", "--peer", "nope"],
        [sys.executable, "-m", "reqscope", "bench", "--peer", "nope"],
        [sys.executable, "-m", "reqscope.bench", "--no-peers", "--peer", LLAMA_CPP],
    ],
)
def test_bad_peer_choice_is_one_line_and_fails_fast(argv, tmp_path):
    done = subprocess.run([*argv, "--model", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], done.stderr


def test_model_that_cannot_load_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "reqscope.bench", "--no-peers", "--model", str(tmp_path / "nothing")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("bench: loading")]
    assert len(lines) == 1 and lines[0].startswith("bench: error:"), done.stderr


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_bytes_per_step_count_a_tied_head_whole_and_an_untied_table_as_one_row(tmp_path, tied):
    from gguf import GGUFReader
    from tiny_gguf import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tied=tied)
    weights, kv = gguf_read_bytes(tiny.path)
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(tiny.path).tensors}
    total = sum(tensors.values())
    embed = tensors["token_embd.weight"]
    rows = len(tiny.vocab.tokens)
    assert weights == (total if tied else total - embed + embed // rows)
    c = tiny.model.config
    assert kv == 2 * 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)


@pytest.mark.skipif(not llama_cpp_installed(), reason="llama_cpp (the peers extra) is not installed")
def test_llama_cpp_child_streams_tokens_when_installed(tmp_path):
    from tiny_gguf import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tied=True)
    weights, kv = gguf_read_bytes(tiny.path)
    plan = PeerPlan(LLAMA_CPP, tiny.path, weights, kv)
    run = stream_run(LLAMA_CPP, llama_child_argv(plan, [1, 5, 6], 4, 1, []), dict(os.environ), timeout_s=300)
    assert 1 <= len(run.tokens) <= 4 and run.environment is not None
    assert "llama-cpp-python" in run.environment.libraries and run.environment.threads == 1
