"""What `reqscope serve` records about each finished request.

Every request leaves the engine's telemetry record (request ID, stage times, token counts,
queue wait, KV, errors, cancellation), extended with its prefix cache stage (blocks looked up
and hit, tokens reused, times), its batch facts (the engine steps it ran in, how many it shared
with other sequences, the mean and largest batch, its prefill chunks and preemptions), the
endpoint it came through and, when
the client went away mid-request, when the server noticed and how many tokens the engine
still produced after that: at most the one step already running when the cancel landed.
A request whose client left while it waited in the queue is recorded as cancelled, with the
time it spent waiting (from tokenization to the end), since nothing failed.
Records are appended as JSON lines to a file and kept in memory for tests and /health.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from minengine.engine.batch_facts import BatchSummary
from minengine.engine.events import PrefixCacheEvent, RequestResult
from minengine.record.telemetry import telemetry_record


@dataclass(frozen=True)
class ServedRequest:
    """One finished request as the server saw it."""

    result: RequestResult
    endpoint: str
    disconnect_ms: float | None = None  # on the request's timeline; None when the client stayed
    @property
    def tokens_after_disconnect(self) -> int | None:
        """Tokens the engine produced after the server noticed the client was gone."""
        if self.disconnect_ms is None:
            return None
        return sum(1 for e in self.result.timeline if e.name == "token" and e.t_ms > self.disconnect_ms)

    def record(self) -> dict:
        """The JSON telemetry line."""
        record = telemetry_record(self.result)
        record["prefix_cache"] = prefix_cache_json(self.result.prefix_cache)
        record["batch"] = batch_json(self.result.batch)
        record["endpoint"] = self.endpoint
        record["client_disconnected_ms"] = None if self.disconnect_ms is None else round(self.disconnect_ms, 3)
        record["tokens_after_disconnect"] = self.tokens_after_disconnect
        return record


def server_report(result: RequestResult) -> dict:
    """The server's measurements of one request, as sent to the client in the extension field.

    The telemetry record plus the visible output token count and the ITL summary; every time
    is on the server's clock, counted from the moment the HTTP request arrived.
    """
    report = telemetry_record(result)
    report["prefix_cache"] = prefix_cache_json(result.prefix_cache)
    report["batch"] = batch_json(result.batch)
    m = result.metrics
    report["output_tokens"] = None if m is None else m.output_tokens
    report["itl_ms"] = None
    if m is not None and m.itl is not None:
        report["itl_ms"] = m.itl.summary()
    return report


def prefix_cache_json(event: PrefixCacheEvent | None) -> dict | None:
    """A request's prefix cache stage as JSON (None when the request never reached it)."""
    if event is None:
        return None
    record = asdict(event)
    for key in ("lookup_ms", "copy_ms", "duration_ms"):
        record[key] = round(record[key], 3)
    return record | {"computed_tokens": event.computed_tokens}


def batch_json(summary: BatchSummary | None) -> dict | None:
    """A request's batch facts as JSON (None when it never reached prefill)."""
    if summary is None:
        return None
    return asdict(summary) | {"mean_batch": round(summary.mean_batch, 3)}


class TelemetryLog:
    """Thread-safe sink for ServedRequests: a JSON-lines file (optional) and a bounded memory."""

    def __init__(self, path: str | Path | None = None, keep: int = 1000) -> None:
        self.path = None if path is None else Path(path)
        self._recent: deque[ServedRequest] = deque(maxlen=keep)
        self._cond = threading.Condition()

    def write(self, served: ServedRequest) -> None:
        """Record one finished request."""
        line = json.dumps(served.record(), ensure_ascii=False)
        with self._cond:
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(line + "\n")
            self._recent.append(served)
            self._cond.notify_all()

    def recent(self) -> tuple[ServedRequest, ...]:
        """The requests kept in memory, oldest first."""
        with self._cond:
            return tuple(self._recent)

    def wait_for(self, request_id: str, timeout_s: float = 10.0) -> ServedRequest | None:
        """The record of `request_id`, waiting up to `timeout_s` for it to be written."""

        def find() -> ServedRequest | None:
            return next((s for s in self._recent if s.result.request_id == request_id), None)

        with self._cond:
            self._cond.wait_for(lambda: find() is not None, timeout=timeout_s)
            return find()
