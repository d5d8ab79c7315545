"""In CI, a skipped test fails the run unless its reason is one the CI machine cannot help.

A live test skips where its server is not provisioned, and the browser test where chromium is
missing: on a developer's machine that is fine, but a CI run green with those skipped has tested
nothing of them. So where `CI` is set (CI runs `.ci/run` with CI=true), every skip's reason is
checked against ALLOWED, the skips that no install can undo on a CPU machine, and
ALLOWED_ON_CPUS_WITHOUT, a CPU feature's tests where this CPU lacks that feature; any other fails
the run with one line per test. Outside CI every skip stays allowed; `-rs` (pyproject.toml) lists
them all the same.

tests/conftest.py loads these hooks; tests/test_skip_policy.py runs them on pytest sessions of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from minengine.settings import cpu_flags

CI_ENV = "CI"


@dataclass(frozen=True)
class AllowedSkip:
    """A skip reason CI accepts (the reason starts with `reason`), and why no CI machine can run it."""

    reason: str
    why: str


ALLOWED = (
    AllowedSkip("needs a CUDA device", "CI's machine has no GPU"),
    AllowedSkip("needs CUDA", "CI's machine has no GPU"),
    AllowedSkip("no AMX tiles granted on this CPU",
                "the CPU lists AMX but the virtual machine does not grant its tiles: hardware, as CUDA is"),
    AllowedSkip("this CPU and torch run every packed kernel",
                "the refusal of a missing packed kernel can only run where one is missing"),
    AllowedSkip("llama_cpp (the peers extra) is not installed",
                "the optional peers extra (llama-cpp-python compiled into the project's venv, minutes) is never "
                "installed by CI; its server is tested live through scripts/peers/llama-cpp-python"),
)  # fmt: skip


@dataclass(frozen=True)
class CpuSkip:
    """A skip reason CI accepts only on a CPU without `flag` (/proc/cpuinfo's name): the kernels it tests
    are not built there, and the same skip on a CPU that has the flag is a failure to build them."""

    reason: str
    flag: str


# The CI machine's CPU is drawn from several kinds (AMX, AVX-512 VNNI, AVX2 only): these run wherever the
# CPU has what they test, and skip, allowed, only where it has not.
ALLOWED_ON_CPUS_WITHOUT = (
    CpuSkip("rounded activations need AVX-512 VNNI", "avx512_vnni"),
    CpuSkip("rounded rows need AVX-512 VNNI", "avx512_vnni"),
    CpuSkip("int16 activations need AVX-512 VNNI", "avx512_vnni"),
    CpuSkip("the rounded twin needs AVX-512 VNNI", "avx512_vnni"),
    CpuSkip("the chunk kernel does not run natively here", "avx512f"),
    CpuSkip("no AVX-512 here", "avx512f"),
)


@dataclass(frozen=True)
class Skip:
    """One test (or module) that skipped, and the reason it gave."""

    where: str
    reason: str


def in_ci() -> bool:
    """Whether this session runs in CI (`CI` set to anything but empty, "0" or "false")."""
    return os.environ.get(CI_ENV, "").strip().lower() not in ("", "0", "false")


def skip_of(report: pytest.TestReport | pytest.CollectReport) -> Skip | None:
    """The skip a report records, or None where it records none (an xfail is not a skip)."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return Skip(report.nodeid or str(report.fspath), reason.removeprefix("Skipped: "))


def allowed(skip: Skip, flags: frozenset[str] | None = None) -> AllowedSkip | CpuSkip | None:
    """The entry of ALLOWED that covers `skip`, or of ALLOWED_ON_CPUS_WITHOUT where this CPU (its `flags`,
    /proc/cpuinfo's by default) lacks the entry's flag; None where none does."""
    found = next((a for a in ALLOWED if skip.reason.startswith(a.reason)), None)
    if found is not None:
        return found
    flags = cpu_flags() if flags is None else flags
    return next((c for c in ALLOWED_ON_CPUS_WITHOUT if skip.reason.startswith(c.reason) and c.flag not in flags), None)


class SkipPolicy:
    """The pytest plugin: keeps every skip the session reports, and in CI fails the run on one not allowed."""

    def __init__(self) -> None:
        self.skips: list[Skip] = []

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        skip = skip_of(report)
        if skip is not None:
            self.skips.append(skip)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Keep every test's skip (its setup's, where a skipif or a fixture skips it)."""
        self._record(report)

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Keep every module's skip (`pytest.skip(..., allow_module_level=True)`)."""
        self._record(report)

    def refused(self) -> list[Skip]:
        """In CI, the skips not in ALLOWED; outside CI, none."""
        return [s for s in self.skips if allowed(s) is None] if in_ci() else []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Fail a run that would otherwise pass where a skip is refused."""
        if self.refused() and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        """Name each refused skip, above the short summary."""
        refused = self.refused()
        if not refused:
            return
        terminalreporter.section("skips CI does not allow", sep="=", red=True, bold=True)
        for skip in refused:
            terminalreporter.write_line(f"{skip.where}: {skip.reason}")
        terminalreporter.write_line(
            f"{len(refused)} skipped for a reason CI can do something about (tests/skip_policy.py lists "
            "the allowed ones): provision what they need"
        )

def register(config: pytest.Config) -> None:
    """Add the skip policy to this pytest session (from a conftest's `pytest_configure`)."""
    if not config.pluginmanager.has_plugin("reqscope-skip-policy"):
        config.pluginmanager.register(SkipPolicy(), "reqscope-skip-policy")

