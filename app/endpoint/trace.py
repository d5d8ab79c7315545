"""An endpoint request as a trace file: every client event, the server's view included, and back.

`reqscope --base-url URL --plain/--json --export DIR` and the explorer's `x` write one;
`reqscope replay FILE` opens it in the endpoint explorer, where every panel (the client's
timeline, the server's split of TTFT, its batch poll by poll, its tokens) draws as it did live.
The records use the engine trace's generic encoding (`minengine.record.trace_io`), with a header
of their own so the two kinds of trace are never confused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minengine.errors import NotATraceError, ReqscopeError
from minengine.record.trace_io import decode_value, encode_value
from reqscope.endpoint import events as ev
from reqscope.endpoint.server.records import BatchSample, PromptProgress

ENDPOINT_TRACE = "endpoint-trace.jsonl"
HEADER_TYPE = "reqscope-endpoint-trace"
FORMAT_VERSION = 1
EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (ev.RequestSent, ev.ConnectionReady, ev.ResponseStarted, ev.ChunkReceived, BatchSample,
                PromptProgress, ev.StreamEnded, ev.SpanReceived)
}


@dataclass(frozen=True)
class EndpointTraceHeader:
    """First line of an endpoint trace: where the request went."""

    url: str
    model: str
    version: int = FORMAT_VERSION


def write_endpoint_trace(folder: Path, header: EndpointTraceHeader, events: Sequence[ev.ClientEvent]) -> Path:
    """Write the trace into `folder` (which must exist); return its path."""
    path = folder / ENDPOINT_TRACE
    lines = [json.dumps({"type": HEADER_TYPE, **encode_value(header)})]
    lines += [json.dumps({"type": type(e).__name__, **encode_value(e)}) for e in events]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def is_endpoint_trace(path: str | Path) -> bool:
    """Whether the file's first line is an endpoint trace's header."""
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline() or "null")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(first, dict) and first.get("type") == HEADER_TYPE


def read_endpoint_trace(path: str | Path) -> tuple[EndpointTraceHeader, list[ev.ClientEvent]]:
    """Read a trace written by `write_endpoint_trace`; one-line errors for anything else."""
    path = Path(path)
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise ReqscopeError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotATraceError(f"{path} is not an endpoint trace ({exc})") from None
    if not records or not isinstance(records[0], dict) or records[0].get("type") != HEADER_TYPE:
        raise NotATraceError(f"{path} is not an endpoint trace (write one with --base-url URL --export DIR)")
    try:
        header = decode_value(EndpointTraceHeader, records[0])
        events = []
        for record in records[1:]:
            cls = EVENT_TYPES.get(record.get("type", ""))
            if cls is None:
                raise ReqscopeError(f"{path}: unknown event type {record.get('type')!r}")
            events.append(decode_value(cls, record))
    except (KeyError, TypeError, ValueError) as exc:
        raise ReqscopeError(f"{path} has a malformed record ({exc}); was it written by another version?") from None
    return header, events
