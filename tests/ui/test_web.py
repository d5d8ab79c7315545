"""`reqscope web`: the explorer served to a real (headless) browser, and its command line.

The browser is Debian's chromium, driven over the DevTools protocol through aiohttp's websocket
client (no Playwright: its browser download needs a network these machines lack). The page
draws the terminal with xterm.js on a canvas, so the test reads the screen from xterm's own
buffer: a script added before the page loads keeps the page's `Terminal` object when textual-
serve's code stores it, and the test reads the visible rows from it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from reqscope.cli import build_parser, main
from reqscope.commands import web

CHROMIUM = Path(os.environ.get("REQSCOPE_CHROMIUM", "/usr/bin/chromium"))
BUDGET_S = 60.0  # the whole browser test, start to finish

# Kept by the page's code as `this.terminal = new Terminal(...)`: an accessor on Object.prototype
# sees that first assignment, keeps the terminal, and turns itself into a plain property there.
KEEP_TERMINAL = """
Object.defineProperty(Object.prototype, "terminal", {
  configurable: true,
  set(value) {
    Object.defineProperty(this, "terminal", {value, writable: true, configurable: true, enumerable: true});
    if (value && value.buffer && !window.__reqscopeTerminal) window.__reqscopeTerminal = value;
  },
});
"""
SCREEN_TEXT = """
(() => {
  const t = window.__reqscopeTerminal;
  if (!t) return "";
  const b = t.buffer.active, rows = [];
  for (let y = 0; y < t.rows; y++) {
    const line = b.getLine(b.viewportY + y);
    rows.push(line ? line.translateToString(true) : "");
  }
  return rows.join("\\n");
})()
"""
OUTPUT_COUNT = re.compile(r"\bout(?:put)? (\d+)/\d+")


class Browser:
    """Headless chromium with one page, driven over the DevTools protocol."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 800) -> None:
        self.profile = profile
        self.size = (width, height)
        self.process: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._next_id = 0

    async def __aenter__(self) -> Browser:
        width, height = self.size
        self.process = subprocess.Popen(
            [
                str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        # With port 0 chromium picks a free port and writes it, first line, to this file.
        port_file = self.profile / "DevToolsActivePort"
        port = await _until(lambda: _first_line(port_file), 20, "chromium's DevTools port")
        self._session = aiohttp.ClientSession()
        pages = await _until_async(lambda: self._pages(int(port)), 10, "chromium's first page")
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        return self

    async def _pages(self, port: int) -> list[dict] | None:
        try:
            async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
                pages = [t for t in await response.json() if t.get("type") == "page"]
        except aiohttp.ClientError:
            return None
        return pages or None

    async def __aexit__(self, *exc) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.process is not None:
            stop_group(self.process)

    async def send(self, method: str, **params) -> dict:
        """Call one DevTools method and return its result (events in between are skipped)."""
        self._next_id += 1
        await self._ws.send_json({"id": self._next_id, "method": method, "params": params})
        while True:
            message = await self._ws.receive_json(timeout=20)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def press(self, key: str) -> None:
        """Type one printable key into the terminal, as a user's key press."""
        await self.evaluate("document.querySelector('.xterm-helper-textarea').focus()")
        code = f"Key{key.upper()}" if key.isalpha() else ""
        common = {"key": key, "code": code, "windowsVirtualKeyCode": ord(key.upper())}
        await self.send("Input.dispatchKeyEvent", type="keyDown", text=key, unmodifiedText=key, **common)
        await self.send("Input.dispatchKeyEvent", type="keyUp", **common)

    async def screen(self) -> str:
        """The terminal's visible rows as text."""
        return await self.evaluate(SCREEN_TEXT) or ""

    async def screenshot(self, path: Path) -> None:
        """The page as a PNG."""
        data = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(data["data"]))


def stop_group(process: subprocess.Popen) -> None:
    """Stop a process started in its own session, with everything it started."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _first_line(path: Path) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return lines[0] if len(lines) >= 2 else None  # written whole: port, then the browser's path


async def _until(probe, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while (value := probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


async def _until_async(probe, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while (value := await probe()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


async def wait_for_screen(browser: Browser, condition, timeout: float, what: str) -> str:
    """Poll the page's terminal until `condition(text)` holds; the last screen goes in the failure."""
    deadline = time.monotonic() + timeout
    text = ""
    while True:
        text = await browser.screen()
        if condition(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; the page shows:\n{text}")
        await asyncio.sleep(0.2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_web(argv: list[str], log: Path) -> subprocess.Popen:
    """`reqscope web ARGV` in its own session (so its browser sessions stop with it)."""
    env = os.environ | {"REQSCOPE_LAYOUT_CACHE": "0"}  # a tiny model: nothing to cache
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "reqscope.cli", "web", *argv],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


async def served(port: int, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Wait until `reqscope web` answers on `port`."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"reqscope web exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/") as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise AssertionError(f"reqscope web did not answer within {timeout:.0f} s:\n{log.read_text()}")
            await asyncio.sleep(0.2)


# -- in a browser -------------------------------------------------------------------------------


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"headless browser test: {CHROMIUM} is not installed "
                    "(apt-get install chromium; .ci/run installs it)")  # fmt: skip
def test_the_explorer_runs_and_steps_in_a_browser(chatty_tiny_dir, tmp_path):
    started = time.monotonic()
    port = free_port()
    log = tmp_path / "web.log"
    argv = ["--port", str(port), "--paused", "--model", str(chatty_tiny_dir), "--device", "cpu",
            "--temperature", "0", "--max-tokens", "64", "Hello"]  # fmt: skip
    server = start_web(argv, log)
    try:
        asyncio.run(asyncio.wait_for(_drive(port, server, log, tmp_path), BUDGET_S))
    finally:
        stop_group(server)
    assert time.monotonic() - started < BUDGET_S


async def _drive(port: int, server: subprocess.Popen, log: Path, tmp_path: Path) -> None:
    await served(port, server, log, timeout=25)
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    async with Browser(profile) as browser:
        await browser.send("Page.enable")
        await browser.send("Page.addScriptToEvaluateOnNewDocument", source=KEEP_TERMINAL)
        await browser.send("Page.navigate", url=f"http://127.0.0.1:{port}/")
        screen = await wait_for_screen(
            browser,
            # The strip shows while the session is still "pausing" (prefill running): wait for the hold.
            lambda text: all(stage in text for stage in ("gateway", "prefill", "decode"))
            and OUTPUT_COUNT.search(text) is not None
            and "paused at step 1" in text,
            timeout=35,
            what="the explorer's pipeline strip, paused at step 1",
        )
        assert "paused at step 1" in screen
        before = int(OUTPUT_COUNT.search(screen)[1])
        await browser.press("s")
        after = await wait_for_screen(
            browser,
            lambda text: (m := OUTPUT_COUNT.search(text)) is not None and int(m[1]) > before,
            timeout=20,  # a busy machine (a full suite, other work) can take seconds per repaint
            what=f"the output token count to pass {before} after pressing s",
        )
        assert int(OUTPUT_COUNT.search(after)[1]) == before + 1
        if shot := os.environ.get("REQSCOPE_WEB_SCREENSHOT"):
            await browser.screenshot(Path(shot))


# -- the command line ---------------------------------------------------------------------------


def test_each_session_gets_the_same_run_flags_and_prompt():
    args = build_parser("web").parse_args(
        ["--port", "9000", "--temperature", "0", "--stop", "a b", "--stop", "x", "--no-cuda-graph",
         "--kv-layout", "mha", "--paused", "--", "-starts with a dash"]
    )  # fmt: skip
    command = web.session_command(args, "/models/m")
    words = command.split(" ")
    assert words[1:5] == ["-m", "reqscope.cli", "web", "--session"]
    parsed = build_parser("web").parse_args(shlex.split(command)[4:])
    assert parsed.session and parsed.paused and parsed.model == "/models/m"
    assert parsed.prompt == "-starts with a dash"
    for name in ("temperature", "stop", "cuda_graph", "kv_layout", "top_k", "max_tokens", "device"):
        assert getattr(parsed, name) == getattr(args, name), name
    assert "--port" not in command and "--host" not in command


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_other_web_sites_cannot_reach_the_server():
    """A page on another site (or a DNS-rebound name) gets 403, not a session to type into."""
    from aiohttp.test_utils import TestClient, TestServer
    from textual_serve.server import Server

    server = web._server_class(Server)("false", host="127.0.0.1", port=0, title="reqscope: test")
    client = TestClient(TestServer(await server._make_app(), host="127.0.0.1"))
    await client.start_server()
    try:
        own = f"http://127.0.0.1:{client.port}"
        page = await client.get("/", headers={"Origin": own})
        assert page.status == 200
        assert f'data-session-websocket-url="ws://127.0.0.1:{client.port}/ws' in await page.text()
        foreign = await client.get("/ws", headers={"Origin": "https://evil.example"})
        assert foreign.status == 403 and "cross-origin" in await foreign.text()
        rebound = f"evil.example:{client.port}"
        for path in ("/", "/ws"):
            answer = await client.get(path, headers={"Host": rebound, "Origin": f"http://{rebound}"})
            assert answer.status == 403, path
    finally:
        await client.close()


@pytest.mark.anyio
async def test_pages_beyond_max_sessions_are_refused_until_one_closes():
    """Each page's session is a process with its own model; past the cap, a clear 503."""
    from aiohttp.test_utils import TestClient, TestServer
    from textual_serve.server import Server

    server = web._server_class(Server)("sleep 30", host="127.0.0.1", port=0, title="reqscope: test")
    server.max_sessions = 1
    client = TestClient(TestServer(await server._make_app(), host="127.0.0.1"))
    await client.start_server()
    own = {"Origin": f"http://127.0.0.1:{client.port}"}
    try:
        first = await client.ws_connect("/ws", headers=own)
        await _until(lambda: True if server.sessions == 1 else None, 10, "the first session to start")
        page = await client.get("/", headers=own)
        assert page.status == 503 and page.headers["Retry-After"] == "5"
        assert "(--max-sessions 1)" in await page.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/ws", headers=own)
        assert refused.value.status == 503
        await first.close()
        await _until_async(_page_status(client, own, 200), 10, "the page to be served again")
        assert server.sessions == 0
    finally:
        await client.close()


def _page_status(client, headers: dict, status: int):
    async def probe() -> bool | None:
        async with await client.get("/", headers=headers) as page:
            return True if page.status == status else None

    return probe


def test_a_port_in_use_is_one_line_and_no_traceback(capsys, chatty_tiny_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["web", "--model", str(chatty_tiny_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"reqscope: error: cannot listen on 127.0.0.1:{port}")
    assert "pick another --port" in err


def test_bad_port_and_missing_model_are_one_line(capsys, tmp_path):
    assert main(["web", "--port", "70000"]) == 2
    assert capsys.readouterr().err.strip() == "reqscope: error: --port 70000 is not a TCP port (1-65535)"
    assert main(["web", "--model", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_a_host_beyond_this_machine_gets_a_warning(capsys, chatty_tiny_dir, monkeypatch):
    class NoServer:
        def __init__(self, command, host, port, title):
            self.command = command

        def serve(self):
            NoServer.served = self.command

    monkeypatch.setattr(web, "_server_class", lambda base: NoServer)
    monkeypatch.setattr(web, "_check_port_free", lambda host, port: None)
    assert main(["web", "--host", "0.0.0.0", "--model", str(chatty_tiny_dir)]) == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if "warning" in line]
    assert len(warnings) == 1 and "anyone who can reach port 8123 can drive the model" in warnings[0]
    assert "--session" in NoServer.served
