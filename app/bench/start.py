"""Start-up and footprint of the real command: `reqscope --plain`, launched as a user would.

Each launch is a fresh interpreter running `python -m reqscope --plain`; the time to its first
byte on stdout is the time to the first visible token (the plain mode writes only the answer
there, flushed token by token). While it runs, a watcher samples its resident-set high-water
mark (VmHWM in /proc on Linux, psutil's RSS elsewhere). The kernel's own peak for the child
(`wait4`) cannot be used: it also counts the benchmark's pages the child briefly shared
between fork and exec, and the benchmark holds two models. A separate launch with
`-X importtime` lists every module the plain path imports, to prove it never loads the UI
toolkit or transformers.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from minengine import settings
from minengine.errors import ReqscopeError

HEAVY_MODULES = ("textual", "transformers")  # must never load on the plain path


@dataclass(frozen=True)
class Launch:
    """One `reqscope --plain` run seen from outside."""

    first_token_s: float
    total_s: float
    peak_rss_bytes: int


@dataclass(frozen=True)
class PlainRun:
    """What to launch: a greedy `reqscope --plain` request."""

    prompt: str
    max_tokens: int
    model_dir: Path | None = None
    device: str = "auto"
    dtype: str = "auto"

    def argv(self, python_flags: tuple[str, ...] = (), max_tokens: int | None = None) -> list[str]:
        """The command line, run by this interpreter."""
        cmd = [sys.executable, *python_flags, "-m", "reqscope", "--plain", "--temperature", "0"]
        cmd += ["--max-tokens", str(max_tokens or self.max_tokens), "--device", self.device, "--dtype", self.dtype]
        if self.model_dir is not None:
            cmd += ["--model", str(self.model_dir)]
        return [*cmd, self.prompt]


def launch_plain(run: PlainRun, env: dict[str, str] | None = None) -> Launch:
    """Launch `reqscope --plain` once; time its first stdout byte and record its peak memory."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(run.argv(), stdout=subprocess.PIPE, stderr=err, env=env)
        watcher = PeakMemory(proc.pid)
        assert proc.stdout is not None
        first = proc.stdout.read(1)
        first_s = time.perf_counter() - start
        proc.stdout.read()
        proc.stdout.close()
        returncode = proc.wait()
        total_s = time.perf_counter() - start
        peak = watcher.stop()
        if returncode != 0 or not first:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
            raise ReqscopeError(f"`reqscope --plain` exited with {returncode}: {' '.join(tail) or 'no output'}")
    return Launch(first_s, total_s, peak)


class PeakMemory:
    """Samples a process's resident-set high-water mark in a background thread until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        self.pid = pid
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(interval_s,), daemon=True)
        self._thread.start()

    def _watch(self, interval_s: float) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, resident_high_water(self.pid))
            self._done.wait(interval_s)

    def stop(self) -> int:
        """Stop sampling; the largest value seen, in bytes."""
        self._done.set()
        self._thread.join()
        return self.peak


def resident_high_water(pid: int) -> int:
    """Peak resident bytes of `pid` so far (VmHWM), or its current RSS where that is unknown; 0 once gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def plain_imports(run: PlainRun, env: dict[str, str] | None = None) -> frozenset[str]:
    """Top-level names of every module a one-token run of `run` imports."""
    done = subprocess.run(run.argv(("-X", "importtime"), 1), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise ReqscopeError(f"`reqscope --plain` exited with {done.returncode} while listing imports")
    names = set()
    for line in done.stderr.splitlines():
        # "import time: self [us] | cumulative | module.name" (nesting shown by indentation)
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    names.discard("imported package")  # the header line
    return frozenset(names)


def heavy_imports(modules: frozenset[str]) -> tuple[str, ...]:
    """Which of HEAVY_MODULES appear in `modules`."""
    return tuple(m for m in HEAVY_MODULES if m in modules)


def child_environment(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without `drop` (settings the benchmark made for itself only)."""
    return {k: v for k, v in settings.environment().items() if k not in drop}
