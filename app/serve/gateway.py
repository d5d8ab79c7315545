"""The gateway stage of `reqscope serve`: arrival time, request ID, API key, rate and size limits.

`Gateway.guard` wraps each API handler. The request's timeline starts there, at the moment the
handler first sees the request, so the server-observed TTFT includes the gateway's own work
and any queue wait; the handler receives it, with the request ID, as an `Arrival`. Failures
answer with OpenAI's error object:

* 401 when API keys are configured and the bearer token is missing or wrong;
* 429 with `Retry-After` when the caller's key (or address, without keys) has used its
  token bucket;
* 413 when the body is larger than the limit (by Content-Length, or while reading a chunked
  body).

`/health` is not guarded, so a load balancer can probe it without a key.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from minengine.engine.timeline import Timeline
from reqscope.openai.schema import ApiError

REQUEST_ID_HEADER = "x-request-id"
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway enforces."""

    api_keys: frozenset[str] = frozenset()  # empty: no authentication
    max_body_bytes: int = 1 << 20
    rate_per_minute: float | None = None  # None: no rate limit
    rate_burst: int = 10


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


class RateLimiter:
    """A token bucket per key: `burst` requests at once, refilled at `per_minute` / 60 per second."""

    def __init__(self, per_minute: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = per_minute / 60.0
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when counted)

    def acquire(self, key: str) -> float:
        """Take one token for `key`: 0.0 when granted, else seconds until one is available."""
        now = self.clock()
        tokens, then = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate_per_s)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate_per_s


def request_id_for(request: web.Request) -> str:
    """The client's x-request-id when it is a sane token, else a fresh one."""
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    return offered if _CLIENT_REQUEST_ID.match(offered) else "req-" + uuid.uuid4().hex[:16]


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Gateway:
    """Wraps handlers with the gateway's checks; a wrapped handler also receives the Arrival."""

    def __init__(self, config: GatewayConfig, limiter: RateLimiter | None = None) -> None:
        self.config = config
        self.limiter = limiter
        if limiter is None and config.rate_per_minute is not None:
            self.limiter = RateLimiter(config.rate_per_minute, config.rate_burst)

    def guard(self, handler: GuardedHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """`handler` behind the gateway: errors answer as OpenAI JSON, every response names its ID."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            timeline = Timeline()
            # The server cannot see the client's send; on its clock the request begins on arrival.
            timeline.mark("client_send", "server clock: taken as the arrival")
            timeline.mark("server_arrival", "HTTP request received")
            arrival = Arrival(request_id_for(request), timeline)
            try:
                self._admit(request)
                response = await handler(request, arrival)
            except ApiError as exc:
                response = error_response(exc)
            except web.HTTPRequestEntityTooLarge:
                response = error_response(self._too_large(None))
            if not response.prepared:  # a stream prepared by the handler already carries it
                response.headers.update(arrival.headers)
            return response

        return guarded

    def _admit(self, request: web.Request) -> None:
        """Key, then rate, then declared size: raise the first ApiError that applies."""
        caller = self._caller(request)
        if self.limiter is not None and (wait_s := self.limiter.acquire(caller)) > 0:
            raise ApiError(
                429,
                f"rate limit reached; retry in {wait_s:.1f} s",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after_s=max(1, math.ceil(wait_s)),
            )
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise self._too_large(request.content_length)

    def _caller(self, request: web.Request) -> str:
        """The caller's identity for rate limiting; raises 401 when a key is required and wrong."""
        token = _bearer(request)
        if self.config.api_keys:
            if token is None:
                raise ApiError(401, "missing API key: send Authorization: Bearer KEY", code="invalid_api_key")
            if token not in self.config.api_keys:
                raise ApiError(401, "incorrect API key", code="invalid_api_key")
            return "key:" + token
        return "addr:" + (request.remote or "unknown")

    def _too_large(self, size: int | None) -> ApiError:
        got = "" if size is None else f" (got {size} bytes)"
        return ApiError(
            413, f"the request body is larger than {self.config.max_body_bytes} bytes{got}", code="payload_too_large"
        )


def error_response(error: ApiError) -> web.Response:
    """OpenAI's error object with the error's status (and Retry-After when set)."""
    headers = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return web.json_response(error.body(), status=error.status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Routing errors (unknown path 404, wrong method 405) in the same OpenAI JSON shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, exc.reason))
