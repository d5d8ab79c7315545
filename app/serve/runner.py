"""Run the serve application: in the foreground (the CLI) or on a background thread (tests, tools).

Both use aiohttp's AppRunner with handler cancellation on: when a client disconnects, its
handler is cancelled at once, even while it waits for the engine, and the handler's cleanup
cancels the engine session.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web


async def _start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}"


async def serve_forever(app: web.Application, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Serve until cancelled (Ctrl-C); `on_ready` receives the base URL once listening."""
    runner, url = await _start(app, host, port)
    on_ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


@dataclass
class BackgroundServer:
    """A server running on its own event loop thread; `url` has no /v1 suffix."""

    url: str
    _loop: asyncio.AbstractEventLoop
    _runner: web.AppRunner
    _thread: threading.Thread

    def stop(self) -> None:
        """Shut the server down and join its thread."""
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


def start_in_thread(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Start serving `app` on a new thread (port 0 picks a free port) and return once listening."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="reqscope-serve", daemon=True)
    thread.start()
    runner, url = asyncio.run_coroutine_threadsafe(_start(app, host, port), loop).result(timeout=30)
    return BackgroundServer(url, loop, runner, thread)
