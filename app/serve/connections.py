"""Connection guards aiohttp lacks: a deadline for a request's head, and a cap on open connections.

aiohttp closes idle keep-alive connections (`keepalive_timeout`, which the runner sets) and
bounds a body's size, but it has no deadline for the request line and headers: a client can
dribble a header byte every few seconds and hold a connection, and a file descriptor, for as
long as it likes; nor does it limit how many connections are open at once. Both are added
here without touching aiohttp's protocol: each connection's aiohttp protocol is wrapped by a
`GuardedConnection`, which sees the bytes arrive, and the `track_requests` middleware tells it
when a request's head is complete (its handler starts) and when the request is over.

* Head deadline: from the moment a connection opens, and from the first byte of each later
  request, the head must be complete within `header_timeout_s`. A connection that sent part of
  a head is answered 408 and closed; one that never sent a byte is just closed (a client must
  not read an answer to a request it has not sent yet).
* Connection cap: a connection opened while `max_connections` are already open is answered
  503 (with Retry-After) on its first request and closed.
* The body deadline lives where the body is read (`body.read_json`); keep-alive idling is
  aiohttp's own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from reqscope.openai.errors import ApiError
from reqscope.serve.access import log_head_timeout
from reqscope.serve.gateway import REQUEST_ID_HEADER, new_request_id


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take, and how many connections may be open at once."""

    header_timeout_s: float = 10.0  # request line and headers, from the first byte
    body_timeout_s: float = 30.0  # the whole body, once the headers are in
    keepalive_timeout_s: float = 75.0  # an idle connection between requests
    write_timeout_s: float = 30.0  # one streamed write the client does not take in (it stopped reading)
    # Above what a load tool opens at once (vLLM's client sends a whole burst, one connection a
    # request) and below the file descriptors a process gets (`ulimit -n`, commonly 1,024 or more).
    max_connections: int = 512


@dataclass
class ConnectionStats:
    """What the guard has done so far (for tests and for reading a server's state)."""

    opened: int = 0
    open_now: int = 0
    peak_open: int = 0
    header_timeouts: int = 0
    over_capacity: int = 0


class ConnectionGuard:
    """The open connections of one server; wraps each new connection's protocol."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.stats = ConnectionStats()

    def protocol_factory(self, make_protocol: Callable[[], asyncio.Protocol]) -> Callable[[], GuardedConnection]:
        """A factory for `loop.create_server` that wraps what `make_protocol` builds."""
        return lambda: GuardedConnection(make_protocol(), self)

    def _opened(self) -> bool:
        """Count a new connection; True when it is over the cap."""
        stats = self.stats
        stats.opened += 1
        stats.open_now += 1
        stats.peak_open = max(stats.peak_open, stats.open_now)
        over = stats.open_now > self.limits.max_connections
        stats.over_capacity += over
        return over

    def _closed(self) -> None:
        self.stats.open_now -= 1


CONNECTION_GUARD = web.AppKey("reqscope_connection_guard", ConnectionGuard)


class GuardedConnection(asyncio.Protocol):
    """An aiohttp connection protocol with a deadline on request heads.

    Every protocol callback is passed on unchanged; the wrapper only starts and stops a timer.
    """

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self.guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._head_started = False  # bytes of the next request have arrived
        self.over_capacity = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Count the connection and start its first head's deadline."""
        self._transport = transport
        self.over_capacity = self.guard._opened()
        self._start_timer()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        """Start the head's deadline on the first byte of a request."""
        if data and not self._in_request:
            self._head_started = True
            if self._timer is None:
                self._start_timer()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:  # noqa: D102 - asyncio.Protocol
        return self._inner.eof_received()

    def pause_writing(self) -> None:  # noqa: D102 - asyncio.Protocol
        self._inner.pause_writing()

    def resume_writing(self) -> None:  # noqa: D102 - asyncio.Protocol
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timer and uncount the connection."""
        self._stop_timer()
        self._transport = None
        self.guard._closed()
        self._inner.connection_lost(exc)

    def request_began(self) -> None:
        """A request's head is complete (its handler is starting)."""
        self._stop_timer()
        self._in_request = True
        self._head_started = False

    def request_ended(self) -> None:
        """The handler is done; the next request's head gets its own deadline."""
        self._in_request = False

    def _start_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.guard.limits.header_timeout_s, self._head_overdue)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_overdue(self) -> None:
        self._timer = None
        transport = self._transport
        if self._in_request or transport is None or transport.is_closing():
            return
        self.guard.stats.header_timeouts += 1
        if self._head_started:  # a request that never became one still gets its access-log line
            request_id, timeout_s = new_request_id(), self.guard.limits.header_timeout_s
            transport.write(_timeout_response(timeout_s, request_id))
            peer = transport.get_extra_info("peername")
            log_head_timeout(peer[0] if isinstance(peer, tuple) else "-", request_id, timeout_s)
        transport.close()  # flushes the 408 first; aiohttp learns of it through connection_lost


def _timeout_response(timeout_s: float, request_id: str) -> bytes:
    """A complete 408 in OpenAI's error shape, written straight to the socket.

    There is no aiohttp request to answer through: its head never finished arriving.
    """
    error = ApiError(408, f"the request headers did not arrive within {timeout_s:g} s", code="request_timeout")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        f"{REQUEST_ID_HEADER}: {request_id}\r\n\r\n"
    )
    return head.encode("ascii") + body


def connection_of(request: web.Request) -> GuardedConnection | None:
    """The guarded connection `request` came on (None when served without the guard)."""
    transport = request.transport
    protocol = None if transport is None else transport.get_protocol()
    return protocol if isinstance(protocol, GuardedConnection) else None


@web.middleware
async def track_requests(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Tell the connection when a request begins and ends; refuse requests over the cap."""
    connection = connection_of(request)
    if connection is None:
        return await handler(request)
    connection.request_began()
    try:
        if connection.over_capacity:
            limit = connection.guard.limits.max_connections
            raise ApiError(
                503,
                f"the server has {limit} connections open, its limit; retry shortly",
                kind="server_busy",
                code="too_many_connections",
                retry_after_s=1,
                close_connection=True,
            )
        return await handler(request)
    finally:
        connection.request_ended()
