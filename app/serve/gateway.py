"""The gateway stage of `reqscope serve`: arrival time, request ID, API key, rate and size limits.

`Gateway.guard` wraps each API handler. The request's timeline starts there, at the moment the
handler first sees the request, so the server-observed TTFT includes the gateway's own work
and any queue wait; the handler receives it, with the request ID, as an `Arrival`. Failures
answer with OpenAI's error object:

* 401 when API keys are configured and the bearer token is missing or wrong; wrong keys are
  compared in constant time and counted per client address, and an address that has used up
  its allowance of failures gets 429 for every key, right or wrong, until it refills (so a
  key cannot be guessed at network speed);
* 429 with `Retry-After` when the caller's key (or address, without keys) has used its
  token bucket;
* 413 when the body is larger than the limit (by Content-Length, or while reading a chunked
  body);
* 415 when a POST body is not declared `application/json`. A browser page may send any site a
  "simple" cross-origin POST (text/plain, forms) without asking first; requiring JSON means
  such a request is refused, and a real JSON one needs a CORS preflight this server never
  grants, so a web page cannot make a keyless local server generate.

`/health` is not guarded, so a load balancer can probe it without a key. The `openai_errors`
middleware sits outside everything: it gives every response, /health and 404s included, an
`x-request-id`, and turns any error (routing, an ApiError, or a bug) into OpenAI's error JSON
rather than aiohttp's text/plain 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from minengine.engine.timeline import Timeline
from reqscope.loopback import host_header_names_loopback
from reqscope.openai.errors import ApiError, shown

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = web.RequestKey("reqscope_request_id", str)
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
JSON_TYPE = "application/json"

log = logging.getLogger("reqscope.serve")


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway enforces."""

    api_keys: frozenset[str] = frozenset()  # empty: no authentication
    # Answer only requests whose Host names this machine (a keyless server on loopback, against
    # web pages that reach it through a DNS-rebound name: see reqscope.loopback).
    loopback_hosts_only: bool = False
    max_body_bytes: int = 1 << 20
    rate_per_minute: float | None = None  # None: no rate limit
    rate_burst: int = 10
    # Wrong API keys one client address may send at once, and how fast that allowance refills.
    auth_failure_burst: int = 10
    auth_failures_per_minute: float = 12.0


@dataclass(frozen=True)
class Arrival:
    """A request that passed the gateway: its ID and its timeline, started on arrival."""

    request_id: str
    timeline: Timeline

    @property
    def headers(self) -> dict[str, str]:
        """Headers every response to this request carries."""
        return {REQUEST_ID_HEADER: self.request_id}


GuardedHandler = Callable[[web.Request, Arrival], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RateLimiter:
    """A token bucket per key: `burst` requests at once, refilled at `per_minute` / 60 per second.

    A bucket that has refilled to full says nothing a fresh one would not, so full buckets are
    dropped, in one sweep each time an empty bucket could have refilled: memory follows the
    clients active lately, not every address ever seen.
    """

    def __init__(self, per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = per_minute / 60.0
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when counted)
        self._refill_s = burst / self.rate_per_s
        self._swept_at = clock()

    def __len__(self) -> int:
        """Keys with a bucket still being tracked."""
        return len(self._buckets)

    def _tokens(self, key: str, now: float) -> float:
        tokens, then = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - then) * self.rate_per_s)

    def acquire(self, key: str) -> float:
        """Take one token for `key`: 0.0 when granted, else seconds until one is available."""
        now = self.clock()
        self._sweep(now)
        tokens = self._tokens(key, now)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate_per_s

    def wait_s(self, key: str) -> float:
        """Seconds until `key` has a token (0.0 when it has one now); takes nothing."""
        now = self.clock()
        self._sweep(now)
        return max(0.0, (1.0 - self._tokens(key, now)) / self.rate_per_s)

    def _sweep(self, now: float) -> None:
        if now - self._swept_at < self._refill_s:
            return
        self._swept_at = now
        for key in [k for k in self._buckets if self._tokens(k, now) >= self.burst]:
            del self._buckets[key]


def new_request_id() -> str:
    """A fresh request ID."""
    return "req-" + uuid.uuid4().hex[:16]


def request_id_for(request: web.Request) -> str:
    """The request's ID: the one `openai_errors` gave it, else the client's when sane, else fresh."""
    if REQUEST_ID in request:
        return request[REQUEST_ID]
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    return offered if _CLIENT_REQUEST_ID.match(offered) else new_request_id()


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _secret(text: str) -> bytes:
    # compare_digest takes str only when ASCII; header values and argv may hold anything.
    return text.encode("utf-8", "surrogateescape")


def retry_error(wait_s: float, message: str, code: str) -> ApiError:
    """A 429 whose message and Retry-After give the same whole number of seconds."""
    retry_after = max(1, math.ceil(wait_s))
    return ApiError(
        429, f"{message}; retry in {retry_after} s", kind="rate_limit_error", code=code, retry_after_s=retry_after
    )


class Gateway:
    """Wraps handlers with the gateway's checks; a wrapped handler also receives the Arrival."""

    def __init__(self, config: GatewayConfig, limiter: RateLimiter | None = None) -> None:
        self.config = config
        self.limiter = limiter
        if limiter is None and config.rate_per_minute is not None:
            self.limiter = RateLimiter(config.rate_per_minute, config.rate_burst)
        self.auth_failures = RateLimiter(config.auth_failures_per_minute, config.auth_failure_burst)
        self._keys = tuple(_secret(k) for k in sorted(config.api_keys))

    def guard(self, handler: GuardedHandler) -> Handler:
        """`handler` behind the gateway's checks; errors propagate as ApiError to `openai_errors`."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            timeline = Timeline()
            # The server cannot see the client's send; on its clock the request begins on arrival.
            timeline.mark("client_send", "server clock: taken as the arrival")
            timeline.mark("server_arrival", "HTTP request received")
            arrival = Arrival(request_id_for(request), timeline)
            self._admit(request)
            try:
                return await handler(request, arrival)
            except web.HTTPRequestEntityTooLarge:  # a chunked body that outgrew the limit
                raise self._too_large(None) from None

        return guarded

    def _admit(self, request: web.Request) -> None:
        """Host, key, then rate, then declared size and type: raise the first ApiError that applies."""
        if self.config.loopback_hosts_only and not host_header_names_loopback(request.host):
            raise ApiError(
                403,
                f"this server has no API key, so it answers only requests addressed to this machine "
                f"(Host 127.0.0.1, ::1 or localhost), not Host {shown(request.host)}; use one of those, or "
                "start it with --api-key",
                kind="permission_error",
                code="host_not_allowed",
            )
        caller = self._caller(request)
        if self.limiter is not None and (wait_s := self.limiter.acquire(caller)) > 0:
            raise retry_error(wait_s, "rate limit reached", "rate_limit_exceeded")
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise self._too_large(request.content_length)
        if request.method == "POST" and request.content_type != JSON_TYPE:
            declared = request.headers.get("Content-Type")
            got = "no Content-Type" if declared is None else f"Content-Type {shown(declared)}"
            raise ApiError(415, f"the body must be JSON sent as Content-Type: {JSON_TYPE} (got {got})",
                           code="unsupported_media_type")  # fmt: skip

    def _caller(self, request: web.Request) -> str:
        """The caller's identity for rate limiting; raises 401 (or 429) when a key is required."""
        address = "addr:" + (request.remote or "unknown")
        if not self._keys:
            return address
        token = _bearer(request)
        if token is None:
            raise ApiError(401, "missing API key: send Authorization: Bearer KEY", code="invalid_api_key")
        if (wait_s := self.auth_failures.wait_s(address)) > 0:
            raise retry_error(wait_s, "too many wrong API keys from this address", "too_many_auth_failures")
        if not self._known(token):
            self.auth_failures.acquire(address)
            raise ApiError(401, "incorrect API key", code="invalid_api_key")
        return "key:" + token

    def _known(self, token: str) -> bool:
        """Whether `token` is a configured key, taking the same time whichever key it is near."""
        offered = _secret(token)
        matched = False
        for key in self._keys:  # every key compared: no early exit tells which one was close
            matched |= hmac.compare_digest(offered, key)
        return matched

    def _too_large(self, size: int | None) -> ApiError:
        got = "" if size is None else f" (got {size} bytes)"
        return ApiError(
            413, f"the request body is larger than {self.config.max_body_bytes} bytes{got}", code="payload_too_large"
        )


def error_response(error: ApiError) -> web.Response:
    """OpenAI's error object with the error's status (and Retry-After when set)."""
    headers = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    response = web.json_response(error.body(), status=error.status, headers=headers)
    if error.close_connection:
        response.force_close()
    return response


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request its ID, and answer every error in OpenAI's JSON shape with that ID.

    Covers routing errors (unknown path 404, wrong method 405), ApiErrors from any stage, and
    unexpected exceptions (a bug: logged with the request ID, answered 500 without details).
    """
    request_id = request[REQUEST_ID] = request_id_for(request)
    try:
        response = await handler(request)
    except ApiError as exc:
        response = error_response(exc)
        if exc.close_connection and not request.content.is_eof():
            # The client stalled mid-body: answer, then hang up instead of reading on.
            response.headers[REQUEST_ID_HEADER] = request_id
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
            return response
    except web.HTTPException as exc:
        if exc.status < 400:
            exc.headers[REQUEST_ID_HEADER] = request_id
            raise
        response = error_response(ApiError(exc.status, exc.reason))
        if "Allow" in exc.headers:  # a 405 names the methods the path takes
            response.headers["Allow"] = exc.headers["Allow"]
    except (asyncio.CancelledError, ConnectionError):  # the client is gone: nobody to answer
        raise
    except Exception:
        log.exception("request %s failed", request_id)
        message = f"the server failed on this request; its log has the details under {request_id}"
        response = error_response(ApiError(500, message, kind="server_error"))
    if not response.prepared:  # a stream prepared by the handler already carries it
        response.headers[REQUEST_ID_HEADER] = request_id
    return response
