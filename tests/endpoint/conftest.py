"""The real vLLM the live endpoint tests share: one per session, started on first use.

It runs with every per-request view on (per-request metrics, prompt token details), tool calls
(hermes's parser, auto tool choice) and its trace
exporter pointed at `otlp_port` on loopback, where each test module that wants spans listens
while it runs (a receiver of its own, or the CLI's `--otlp-listen`). Starting vLLM takes about
70 s here, so the modules share it rather than start one each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from peers import free_port, vllm_python

VLLM_MODEL = "smollm2"
HEALTH_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class VllmServer:
    """A running vLLM: its root URL (without /v1), the port its spans go to, and its log."""

    root: str
    otlp_port: int
    log: Path

    @property
    def v1(self) -> str:
        """The OpenAI base URL."""
        return self.root + "/v1"


@pytest.fixture(scope="session")
def vllm_server(default_model_dir, tmp_path_factory) -> Iterator[VllmServer]:
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM is not provisioned: run scripts/peers/vllm")
    port, otlp_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # its default is gRPC
    }
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(default_model_dir), "--served-model-name", VLLM_MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
        "--enable-per-request-metrics", "--enable-prompt-tokens-details",
        "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces",
        # Tools: vLLM 0.32 refuses any tool_choice (a named one and "required" included) without a parser.
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    with log.open("wb") as out:
        # A session of its own: vLLM starts an engine core and a worker process, stopped with it.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(root, process, log)
        yield VllmServer(root, otlp_port, log)
    finally:
        stop_process_group(process)


def _wait_healthy(root: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM exited with {process.returncode} before /health answered:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(root + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"vLLM's /health did not answer within {HEALTH_TIMEOUT_S:.0f} s:\n{log_tail(log)}")


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group, SIGKILL if it has not gone in 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def log_tail(log: Path, lines: int = 30) -> str:
    """The last lines of a server's log, for a failure message."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
