"""One access-log line per HTTP request, through `logging` (logger `reqscope.access`).

The `access_log` middleware sits outside every other, so it sees the status the client really
got, errors included. A generation request's line also carries its engine numbers (prompt and
output tokens, finish reason, TTFT, E2E), which exist only once the engine session has ended.
Normally that is before the response finishes; when the client goes away mid-request, the
handler is cancelled at once while the session still runs up to one more step, so the line is
written when the later of the two ends, and always exactly once. A client that left before
its response began is logged with nginx's 499 ("client closed request").

Each line is one `logging` record at INFO whose message reads
`POST /v1/chat/completions 200 req-... client=127.0.0.1 prompt_tokens=12 output_tokens=8
finish=length ttft_ms=23.4 e2e_ms=81.0 ms=85.2` (fields that do not apply are left out), and
which carries the same values as an `AccessRecord` in its `access` attribute, for handlers that
want them structured. Client errors are lines like any other: no traceback is logged for them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from minengine.engine.events import RequestResult
from reqscope.openai.responses import api_finish_reason
from reqscope.serve.gateway import REQUEST_ID

ACCESS_LOGGER = "reqscope.access"
LOG_LEVELS = ("debug", "info", "warning", "error")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its response began
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

access_logger = logging.getLogger(ACCESS_LOGGER)


@dataclass(frozen=True)
class AccessRecord:
    """What one access-log line says; None for a field that does not apply to the request."""

    method: str
    path: str
    status: int
    request_id: str
    client: str
    duration_ms: float  # arrival to the end of the response, on the server
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None  # as the API names it
    ttft_ms: float | None = None
    e2e_ms: float | None = None

    def line(self) -> str:
        """The log message: `METHOD PATH STATUS ID key=value ...`."""
        parts = [self.method, self.path, str(self.status), self.request_id, f"client={self.client}"]
        for key, value in (
            ("prompt_tokens", self.prompt_tokens),
            ("output_tokens", self.output_tokens),
            ("finish", self.finish_reason),
            ("ttft_ms", self.ttft_ms),
            ("e2e_ms", self.e2e_ms),
            ("ms", self.duration_ms),
        ):
            if value is not None:
                parts.append(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}")
        return " ".join(parts)


@dataclass
class AccessEntry:
    """A request's line in the making: the HTTP side and (for generation) the engine side.

    `http_ended` is called on the event loop, `engine_ended` from the engine's worker thread;
    whichever comes second writes the line.
    """

    method: str
    path: str
    client: str
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None  # set once a streamed response has sent its status
    result: RequestResult | None = None
    _request_id: str = "-"
    _duration_ms: float = 0.0
    _http_over: bool = False
    _engine_running: bool = False
    _written: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def engine_started(self) -> None:
        """An engine session now runs for this request; the line waits for its end."""
        with self._lock:
            self._engine_running = True

    def engine_ended(self, result: RequestResult | None) -> None:
        """The engine session is over (`result` is None when it crashed)."""
        with self._lock:
            if result is not None:
                self.result = result
            self._engine_running = False
            ready = self._http_over
        if ready:
            self._write()

    def http_ended(self, status: int, request_id: str) -> None:
        """The response is over (or the client is gone, with `status` as it stands)."""
        with self._lock:
            self.status, self._request_id = status, request_id
            self._duration_ms = (time.perf_counter() - self.started) * 1000
            self._http_over = True
            ready = not self._engine_running
        if ready:
            self._write()

    def record(self) -> AccessRecord:
        """The line's values as they stand."""
        values = AccessRecord(
            self.method, self.path, self.status or 0, self._request_id, self.client, self._duration_ms
        )
        result = self.result
        if result is None:
            return values
        metrics = result.metrics
        return replace(
            values,
            prompt_tokens=result.usage.prompt_tokens,
            output_tokens=result.usage.completion_tokens,
            finish_reason=api_finish_reason(result.finish_reason),
            ttft_ms=None if metrics is None else metrics.ttft_ms,
            e2e_ms=None if metrics is None else metrics.e2e_ms,
        )

    def _write(self) -> None:
        with self._lock:
            if self._written:
                return
            self._written = True
        if access_logger.isEnabledFor(logging.INFO):
            record = self.record()
            access_logger.info("%s", record.line(), extra={"access": record})


ACCESS = web.RequestKey("reqscope_access", AccessEntry)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def access_entry(request: web.Request) -> AccessEntry | None:
    """The request's entry (None when the app runs without the `access_log` middleware)."""
    return request.get(ACCESS)


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Log one line when the request is over; must be the outermost middleware."""
    entry = request[ACCESS] = AccessEntry(request.method, request.path, request.remote or "-")
    status = 500  # only an exception the inner middlewares let through leaves it so
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # a redirect, which `openai_errors` passes on as it is
        status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionError):
        status = entry.status or CLIENT_CLOSED_REQUEST
        raise
    finally:
        entry.http_ended(status, request.get(REQUEST_ID, "-"))


def log_head_timeout(client: str, request_id: str, waited_s: float) -> None:
    """The line for a request whose head never finished arriving (answered 408 by the connection guard)."""
    record = AccessRecord("-", "-", 408, request_id, client, waited_s * 1000)
    access_logger.info("%s", record.line(), extra={"access": record})


class ClientErrorsInOneLine(logging.Filter):
    """Turns a record carrying a client's HTTP error (bytes that are not HTTP) into one line.

    aiohttp logs such requests, which never reach a handler, with a traceback (at debug level);
    the fault is the client's, so the traceback says nothing about the server.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop the traceback of an HttpProcessingError, keeping its status and reason."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = " ".join(str(exc.message).split())
            record.msg, record.args = f"{record.getMessage()}: {exc.code} {reason}", ()
            record.exc_info, record.exc_text = None, None
        return True


def configure_logging(level: str, stream: TextIO = sys.stderr) -> None:
    """Logging for `reqscope serve`: `level` (one of LOG_LEVELS) and up on `stream`, one line each."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=stream, force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(ClientErrorsInOneLine())
