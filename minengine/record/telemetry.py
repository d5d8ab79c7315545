"""The one JSON telemetry record a finished request leaves behind."""

from __future__ import annotations

from dataclasses import asdict

from minengine.engine.events import RequestResult
from minengine.kv.usage import BlockSharing


def telemetry_record(r: RequestResult) -> dict:
    """Request ID, stage times, token counts, queue wait, latency (wall clock and engine), KV, errors, cancellation."""
    m, e = r.metrics, r.engine_metrics
    return {
        "request_id": r.request_id,
        "finish_reason": r.finish_reason,
        "cancelled": r.finish_reason == "cancelled",
        "error": r.error,
        "usage": asdict(r.usage),
        "queue_wait_ms": round(r.queue_ms, 3),
        "stages_ms": {s.name: round(s.duration_ms, 3) for s in r.stages},
        "events_ms": {e.name: round(e.t_ms, 3) for e in r.timeline if e.name != "token"},
        "ttft_ms": None if m is None else m.ttft_ms,
        "e2e_ms": None if m is None else m.e2e_ms,
        "tpot_ms": None if m is None else m.tpot_ms,
        # The times above are the wall clock's; these leave out the time the run was held at a
        # step (the explorer's pause and step), equal to them when nobody held it.
        "held_ms": round(r.held_ms, 3),
        "engine_metrics": None if e is None else {"ttft_ms": e.ttft_ms, "e2e_ms": e.e2e_ms, "tpot_ms": e.tpot_ms},
        "kv_peak_logical_bytes": None if r.kv_peak is None else r.kv_peak.logical_bytes,
        "kv_peak_physical_bytes": None if r.kv_peak is None else r.kv_peak.physical_bytes,
        "kv_peak_blocks": None if r.kv_peak is None else block_sharing_json(r.kv_peak.sharing),
        "sampler_order": list(r.sampler_order),
    }


def block_sharing_json(s: BlockSharing | None) -> dict | None:
    """A paged cache's blocks by who else holds them, counts and bytes; None for a cache outside the pool."""
    if s is None:
        return None
    return {
        "blocks": s.blocks,
        "own": s.own,
        "with_requests": s.with_requests,
        "with_prefix": s.with_prefix,
        "own_bytes": s.own_bytes,
        "with_requests_bytes": s.with_requests_bytes,
        "with_prefix_bytes": s.with_prefix_bytes,
    }
