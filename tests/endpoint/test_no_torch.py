"""`reqscope --base-url URL` only speaks HTTP: nothing on its path loads torch.

Each check runs in a fresh interpreter, where a module that imported torch at any depth leaves it
in `sys.modules`. A watcher in that interpreter prints the stack of the first import of torch, so
a failure names the import that brought it in.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from serve_harness import KEY, serving

from minengine.engine.engine import Engine

# Everything `reqscope --base-url URL` runs through: the CLI and its run verb (whose flags it
# parses), the client, both text printers, and the endpoint explorer with its launcher.
ENDPOINT_PATH = (
    "reqscope.cli",
    "reqscope.commands.run",
    "reqscope.endpoint.run",
    "reqscope.endpoint.plain",
    "reqscope.endpoint.jsonl",
    "reqscope.ui.endpoint.launch",
    "reqscope.ui.endpoint.app",
)

# Everything `reqscope bench serve` runs through: the bench verb (whose flags it parses) and the load.
BENCH_SERVE_PATH = (
    "reqscope.commands.bench",
    "reqscope.bench.serve.cli",
    "reqscope.bench.serve.load",
    "reqscope.bench.serve.summary",
)

WATCH_TORCH = """
import sys, traceback
class _WatchTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("torch imported here:\\n" + "".join(traceback.format_stack()), file=sys.stderr)
        return None
sys.meta_path.insert(0, _WatchTorch())
"""

# The explorer on a terminal, headless: it runs until its request has ended, then closes.
HEADLESS_EXPLORER = """
from textual.app import App
from reqscope.ui.endpoint.app import EndpointApp

def _headless(app, **_options):
    async def until_done(pilot):
        while app.view.result is None:
            await pilot.pause(0.05)
        app.exit()
    return App.run(app, headless=True, size=(160, 48), auto_pilot=until_done)

EndpointApp.run = _headless
sys.stdout.isatty = lambda: True
"""


def _run(code: str) -> list[str]:
    """Run `code` after the watcher in a fresh interpreter; the lines it printed."""
    done = subprocess.run([sys.executable, "-c", WATCH_TORCH + code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "torch imported here" not in done.stderr, done.stderr
    return done.stdout.splitlines()


def test_importing_the_endpoint_path_leaves_torch_out():
    imports = "".join(f"import {name}\n" for name in ENDPOINT_PATH + BENCH_SERVE_PATH)
    # The probe sees torch when something does load it (the engine's KV cache makes tensors);
    # the watcher goes first, as that import is meant.
    probe = (
        "print('torch' in sys.modules)\n"
        "sys.meta_path.pop(0)\n"
        "import minengine.kv.cache\n"
        "print('torch' in sys.modules)\n"
    )
    assert _run(imports + probe)[-2:] == ["False", "True"]


@pytest.fixture(scope="module")
def served(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20)
    with serving(engine) as s:
        yield s


def test_a_whole_endpoint_request_leaves_torch_out(served):
    # --plain, --json and the explorer, each to the end of a streamed request from `reqscope serve`.
    argv = ["--base-url", served.v1, "--api-key", KEY, "--temperature", "0", "--max-tokens", "3", "hi"]
    code = (
        "from reqscope.cli import main\n"
        f"print(main({[*argv[:-1], '--plain', 'hi']!r}), main({[*argv[:-1], '--json', 'hi']!r}))\n"
        + HEADLESS_EXPLORER
        + f"print(main({argv!r}))\n"
        "print('torch' in sys.modules)\n"
    )
    lines = _run(code)
    assert lines[-1] == "False"
    assert lines[-2] == "0" and "0 0" in lines  # every mode finished its request


def test_a_whole_bench_serve_run_leaves_torch_out(served, chatty_tiny_dir):
    argv = ["bench", "serve", "--base-url", served.url, "--api-key", KEY, "--tokenizer", str(chatty_tiny_dir),
            "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--json"]  # fmt: skip
    code = f"from reqscope.cli import main\nprint(main({argv!r}))\nprint('torch' in sys.modules)\n"
    lines = _run(code)
    assert lines[-1] == "False" and lines[-2] == "0"
    assert '"completed": 2' in lines[-3]
