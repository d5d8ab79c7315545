"""Running an engine in its own process and timing its tokens as they arrive on the pipe.

Every side of the fair comparison is a child process that writes one JSON object per line,
flushed as it happens: `reqscope --json` as users run it, and the small child scripts for
transformers (`hf_child`) and llama.cpp (`llama_child`), which speak the same events. The
parent stamps each line with its own clock when the line arrives, so every engine's decode rate
is measured the same way, from outside, and nothing an engine reports about itself enters the
rate. The first token is excluded (it ends the prefill); the rate is the tokens after it over
the time from its arrival to the last one's.

Events read here (others are ignored):

- `{"event": "environment", "omp_wait_policy": ..., "threads": ..., "libraries": ...}`: what the
  child ran with, as it saw it (the children write it; `reqscope --json` does not);
- `{"event": "token", "token_id": ...}`: one generated token (`reqscope --json` adds the bytes its
  decode step read, `bytes_read`, kept as the child's own report);
- `{"event": "done", ...}`: the end, with the child's own request-to-first-token time
  (`first_token_ms`, or `reqscope --json`'s `metrics.ttft_ms`) and the prompt's length
  (`prompt_tokens`, or `usage.prompt_tokens`);
- `{"event": "error", "message": ...}`: a failure, raised as a one-line error.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from minengine.errors import ReqscopeError
from reqscope.bench.start import PeakMemory, resident_high_water


@dataclass(frozen=True)
class ChildEnvironment:
    """What one side ran with, as its process saw it."""

    omp_wait_policy: str  # OMP_WAIT_POLICY as the process had it when its runtime loaded, or "not set"
    threads: int  # torch intra-op threads, or llama.cpp's n_threads
    libraries: str  # e.g. "torch 2.13.0+cpu, transformers 5.24.0"

    def describe(self) -> str:
        """One line: policy, threads, libraries."""
        return f"OMP_WAIT_POLICY {self.omp_wait_policy}, {self.threads} thread(s), {self.libraries}"

    def write(self, out: TextIO) -> None:
        """Write this as a child's `environment` event (what `stream_run` reads back)."""
        emit(out, event="environment", **asdict(self))


@dataclass(frozen=True)
class StreamedRun:
    """One child's generation as the parent saw it: the tokens and when each arrived."""

    tokens: tuple[int, ...]
    arrival_s: tuple[float, ...]  # parent's clock, seconds after the launch, one per token
    first_token_ms: float | None  # the child's own time from the request to its first token
    prompt_tokens: int | None
    environment: ChildEnvironment | None
    bytes_read: tuple[int, ...] = ()  # per decode step, where the child reports it (`reqscope --json`)
    peak_rss_bytes: int | None = None  # the child's resident high-water mark, when watched

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time from the first one's arrival to the last one's."""
        if len(self.arrival_s) < 2:
            raise ReqscopeError(f"a decode rate needs at least 2 tokens, the child sent {len(self.arrival_s)}")
        span = self.arrival_s[-1] - self.arrival_s[0]
        return (len(self.arrival_s) - 1) / span if span > 0 else float("inf")


def emit(out, **record: Any) -> None:
    """Write one event line and flush it (what the child scripts call)."""
    out.write(json.dumps(record) + "\n")
    out.flush()


def stream_run(
    name: str, argv: Sequence[str], env: dict[str, str], timeout_s: float = 900.0, watch_memory: bool = False
) -> StreamedRun:
    """Launch `argv` with exactly `env`, stamp each token line on arrival, and wait for the end
    (`watch_memory`: sample the child's resident high-water mark meanwhile, `start.PeakMemory`).

    A child that fails, times out or sends an error event is a one-line ReqscopeError naming `name`.
    """
    tokens: list[int] = []
    arrivals: list[float] = []
    bytes_read: list[int] = []
    peak: int | None = None
    environment: ChildEnvironment | None = None
    first_token_ms: float | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=err, env=env)
        memory = PeakMemory(proc.pid) if watch_memory else None
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.perf_counter() - start
                record = _record(line)
                kind = record.get("event")
                if kind == "token":
                    tokens.append(int(record["token_id"]))
                    arrivals.append(now)
                    if isinstance(record.get("bytes_read"), int):
                        bytes_read.append(record["bytes_read"])
                elif kind == "environment":
                    environment = ChildEnvironment(
                        str(record["omp_wait_policy"]), int(record["threads"]), str(record["libraries"])
                    )
                elif kind == "done":
                    first_token_ms, prompt_tokens = _done_figures(record)
                elif kind == "error":
                    error = str(record.get("message", "unknown error"))
            if memory is not None:
                peak = max(memory.peak, resident_high_water(proc.pid))  # before it is reaped
            returncode = proc.wait()
        finally:
            timer.cancel()
            if memory is not None:
                peak = max(peak or 0, memory.stop())
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if error is not None:
            raise ReqscopeError(f"{name}: {error}")
        if returncode != 0:
            err.seek(0)
            raise ReqscopeError(f"{name} exited with {returncode}: {_last_line(err.read())}")
    return StreamedRun(tuple(tokens), tuple(arrivals), first_token_ms, prompt_tokens, environment,
                       tuple(bytes_read), peak)  # fmt: skip


def _record(line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError:
        return {}  # not an event: a library's stray print
    return record if isinstance(record, dict) else {}


def _done_figures(record: dict[str, Any]) -> tuple[float | None, int | None]:
    first = record.get("first_token_ms")
    if first is None:
        first = (record.get("metrics") or {}).get("ttft_ms")
    prompt = record.get("prompt_tokens")
    if prompt is None:
        prompt = (record.get("usage") or {}).get("prompt_tokens")
    return (None if first is None else float(first)), (None if prompt is None else int(prompt))


def _last_line(stderr: bytes) -> str:
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no message"
