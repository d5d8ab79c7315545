"""Run the serve application: in the foreground (the CLI) or on a background thread (tests, tools).

Both use aiohttp's AppRunner with handler cancellation on: when a client disconnects, its
handler is cancelled at once, even while it waits for the engine, and the handler's cleanup
cancels the engine session. The runner sets aiohttp's keep-alive timeout from the app's
`ConnectionLimits`; the listening socket is opened here rather than by a TCPSite so that each
connection's protocol can be wrapped by the app's `ConnectionGuard` (header deadline,
connection cap), which aiohttp has no option for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from reqscope.serve.connections import CONNECTION_GUARD, ConnectionGuard, ConnectionLimits


@dataclass
class _Listening:
    """An app being served: its aiohttp runner and the socket it listens on."""

    runner: web.AppRunner
    listener: asyncio.Server
    url: str

    async def close(self) -> None:
        """Stop accepting, then shut down open connections and the app."""
        self.listener.close()
        await self.runner.cleanup()


async def _start(app: web.Application, host: str, port: int) -> _Listening:
    guard = app.get(CONNECTION_GUARD) or ConnectionGuard(ConnectionLimits())
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, keepalive_timeout=guard.limits.keepalive_timeout_s
    )
    await runner.setup()
    try:
        listener = await asyncio.get_running_loop().create_server(guard.protocol_factory(runner.server), host, port)
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = listener.sockets[0].getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return _Listening(runner, listener, f"http://{shown}:{bound_port}")


async def serve_forever(app: web.Application, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Serve until cancelled (Ctrl-C); `on_ready` receives the base URL once listening."""
    listening = await _start(app, host, port)
    on_ready(listening.url)
    try:
        await asyncio.Event().wait()
    finally:
        await listening.close()


@dataclass
class BackgroundServer:
    """A server running on its own event loop thread; `url` has no /v1 suffix."""

    url: str
    _loop: asyncio.AbstractEventLoop
    _listening: _Listening
    _thread: threading.Thread

    def stop(self) -> None:
        """Shut the server down and join its thread."""
        asyncio.run_coroutine_threadsafe(self._listening.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


def start_in_thread(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Start serving `app` on a new thread (port 0 picks a free port) and return once listening."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="reqscope-serve", daemon=True)
    thread.start()
    listening = asyncio.run_coroutine_threadsafe(_start(app, host, port), loop).result(timeout=30)
    return BackgroundServer(listening.url, loop, listening, thread)
