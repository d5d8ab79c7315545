"""The step's thread count: chosen from the machine's state, never changing a value."""

from __future__ import annotations

import pytest
import torch

from minengine import omp_env
from minengine.config import ModelConfig
from minengine.fast import decode_threads
from minengine.fast.decode_threads import StepThreads
from minengine.omp_env import MachineSample
from minengine.steps.load import load_model
from minengine.steps.model_runner import ModelRunner

CPU = torch.device("cpu")


class FakeMachine:
    """/proc/stat as a test wants it: others use `others` cores; time moves on by a window per look."""

    def __init__(self, others: float) -> None:
        self.others, self.wall, self.busy, self.own = others, 0.0, 0.0, 0.0

    def __call__(self) -> MachineSample:
        span = decode_threads.WINDOW_S * 1.01  # a little over: sums of floats drift
        self.wall += span
        self.own += span  # this process: one core
        self.busy += span * (1 + self.others)
        return MachineSample(self.wall, self.busy, self.own)


def test_others_since_counts_what_this_process_did_not():
    a, b = MachineSample(10.0, 100.0, 5.0), MachineSample(10.5, 101.0, 5.5)
    assert b.others_since(a) == pytest.approx(1.0)  # 1 s busy in 0.5 s, 0.5 s of it ours: 1 core
    assert MachineSample(10.0, 100.0, 5.0).others_since(a) is None
    assert omp_env.sample_machine() is None or omp_env.sample_machine().machine_busy > 0


@pytest.mark.parametrize(("others", "expected"), [(0.0, 2), (0.1, 2), (0.35, 2), (0.9, 1)])
def test_one_thread_while_other_processes_want_a_core(monkeypatch, others, expected):
    machine = FakeMachine(others)
    monkeypatch.setattr(omp_env, "sample_machine", machine)
    threads = StepThreads(2, steer=True)
    threads.count()  # the first look only takes a baseline
    assert [threads.count() for _ in range(3)] == [expected] * 3
    machine.others = 0.0 if expected == 1 else 1.0  # the machine changes: so does the choice
    assert threads.count() == 3 - expected


def _slow_run(threads: StepThreads) -> None:
    for _ in range(decode_threads.SLOW_RUN):
        threads.record(2, 0.300)  # the cores were not free after all (our own threads, say)


def test_steps_far_slower_than_the_best_back_off_to_one_thread(monkeypatch):
    monkeypatch.setattr(omp_env, "sample_machine", FakeMachine(0.0))
    threads = StepThreads(2, steer=True)
    for seconds in (0.020, 0.016, 0.017):
        threads.record(2, seconds)
    assert threads.count() == 2
    _slow_run(threads)
    taken = [threads.count() for _ in range(decode_threads.BACKOFF_STEPS + 1)]
    assert taken[:-1] == [1] * decode_threads.BACKOFF_STEPS and taken[-1] == 2
    _slow_run(threads)  # again: twice as long on one thread
    backoff = decode_threads.BACKOFF_STEPS
    assert sum(threads.count() == 1 for _ in range(4 * backoff)) == 2 * backoff


def test_a_lone_slow_step_is_a_burst_not_a_lost_core(monkeypatch):
    monkeypatch.setattr(omp_env, "sample_machine", FakeMachine(0.0))
    threads = StepThreads(2, steer=True)
    threads.record(2, 0.016)
    for _ in range(50):  # a frame drawn beside every other step, as in the explorer
        for seconds in [0.300] * (decode_threads.SLOW_RUN - 1) + [0.017]:
            threads.record(2, seconds)
            assert threads.count() == 2
    _slow_run(threads)
    assert threads.count() == 1


def test_not_steered_unless_this_process_chose_to_spin(monkeypatch):
    monkeypatch.setattr(omp_env, "_spin_here", False)
    assert not StepThreads(2).steer and StepThreads(2).count() == 2
    assert not StepThreads(1, steer=True).steer  # one thread: nothing to choose


def test_the_command_spins_only_for_a_request(monkeypatch):
    for name in (omp_env.VARIABLE, omp_env.SPIN_VARIABLE):
        monkeypatch.setenv(name, "")  # recorded, so whatever choose_policy sets is undone after
        monkeypatch.delenv(name)
    monkeypatch.setattr(omp_env, "_set_here", False)
    monkeypatch.setattr(omp_env, "_spin_here", False)
    omp_env.choose_policy(decodes=True)
    if omp_env.sample_machine() is not None:
        assert omp_env.spins_while_decoding() and omp_env.set_here()
        assert omp_env.describe() == f"not set, {omp_env.SPIN_VARIABLE}={omp_env.SPIN_COUNT}"
        assert omp_env.SPIN_VARIABLE not in omp_env.user_environment()
    monkeypatch.setenv(omp_env.VARIABLE, "ACTIVE")  # the user's setting wins, and is handed on
    monkeypatch.setattr(omp_env, "_spin_here", False)
    omp_env.choose_policy(decodes=True)
    assert not omp_env.spins_while_decoding() and omp_env.user_environment()[omp_env.VARIABLE] == "ACTIVE"


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 CPU threads")
def test_the_thread_count_never_changes_a_logit(tiny_models):
    cfg = ModelConfig.from_file(tiny_models["llama-gqa"][0])
    runner = ModelRunner(load_model(tiny_models["llama-gqa"][0], cfg, torch.float32, CPU))
    ids = torch.arange(3, 15)

    def decode(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        try:
            cache = runner.new_cache(20)
            out = [runner.forward(ids, 0, cache)]
            for pos in range(12, 18):
                out.append(runner.forward(out[-1].argmax().view(1), pos, cache))
            return out
        finally:
            torch.set_num_threads(2)

    for a, b in zip(decode(2), decode(1), strict=True):
        assert torch.equal(a, b)
