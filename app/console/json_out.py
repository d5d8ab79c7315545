"""What both --json printers (the local run's and the endpoint client's) write the same way.

One record a line, flushed as it is written so a reader sees each event as it happens, and the
metric set's keys, which the engine's `done` record and the endpoint's share.
"""

from __future__ import annotations

import json
from typing import TextIO

from minengine.engine.metrics import RequestMetrics


def emit(out: TextIO, record: dict) -> None:
    """Write `record` as one JSON line and flush it."""
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()


def metrics_json(m: RequestMetrics | None) -> dict | None:
    """One metric set as --json writes it; None when there is none."""
    if m is None:
        return None
    return {
        "ttft_ms": m.ttft_ms,
        "e2e_ms": m.e2e_ms,
        "tpot_ms": m.tpot_ms,
        "itl_ms": None if m.itl is None else m.itl.summary(),
        "decode_output_tokens_per_second": m.decode_output_tokens_per_second,
        "whole_request_output_tokens_per_second": m.whole_request_output_tokens_per_second,
    }
