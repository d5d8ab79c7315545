"""Write one run to a folder: timeline CSV, metrics JSON, event trace, Perfetto trace, telemetry.

One folder holds one run. A run that shows no visible token writes no timeline CSV, so writing
a second run over a first would leave the first run's CSV beside the second's other files:
a folder that already holds files is refused unless the caller forces it, and then the
previous export files are removed first. The folder is prepared, and its writability
checked, before the request runs, so a bad path costs no generation.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from minengine.engine.events import RequestResult
from minengine.engine.metrics import RequestMetrics
from minengine.engine.timeline import TimelineEvent
from minengine.errors import Mention, ReqscopeError, Setting
from minengine.kv.arithmetic import MIB
from minengine.record.telemetry import telemetry_record
from minengine.record.timeline_csv import TimelineFile, write_timeline
from minengine.record.trace_io import TraceHeader, write_trace

TIMELINE_CSV = "request-timeline.csv"
METRICS_JSON = "request-metrics.json"
TRACE_JSONL = "request-trace.jsonl"
PERFETTO_JSON = "request-trace.perfetto.json"
TELEMETRY_JSON = "request-telemetry.json"
EXPORT_FILES = (TIMELINE_CSV, METRICS_JSON, TRACE_JSONL, PERFETTO_JSON, TELEMETRY_JSON)


def prepare_export_folder(folder: str | Path, *, force: bool = False) -> Path:
    """Create `folder` for one run's export and check now that it can be written.

    A folder that already holds files is refused, unless `force`: then the export files of the
    run before are removed (other files are left alone), so no two runs' files sit side by side.
    """
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise ReqscopeError(Mention(Setting.EXPORT_DIR, str(out)), " is a file, not a folder; choose a new folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        present = sorted(entry.name for entry in out.iterdir())
        if present and not force:
            shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
            raise ReqscopeError(
                Setting.EXPORT_DIR,
                f" folder {out} already holds files ({shown}); choose a new folder, or add ",
                Setting.EXPORT_REPLACES,
                " to replace the export files in it",
            )
        for name in EXPORT_FILES:
            (out / name).unlink(missing_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".reqscope-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = exc.strerror or exc
        raise ReqscopeError(
            "cannot write to ", Setting.EXPORT_DIR, f" folder {out} ({why}); choose another folder"
        ) from None
    return out


def export_run(result: RequestResult, folder: str | Path, events: Sequence, header: TraceHeader) -> list[Path]:
    """Write every export file into `folder` (created if needed); return the paths."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / name for name in EXPORT_FILES]
        if result.metrics is not None:
            write_timeline(paths[0], csv_timeline(result))
        else:
            paths.remove(paths[0])  # no visible token: the seed's format has nothing to hold
        _write_json(out / METRICS_JSON, metrics_record(result))
        write_trace(out / TRACE_JSONL, header, events)
        _write_json(out / PERFETTO_JSON, perfetto_trace(result))
        _write_json(out / TELEMETRY_JSON, telemetry_record(result))
    except OSError as exc:
        raise ReqscopeError(
            f"cannot export to {out}: {exc.strerror or exc}; choose another ", Setting.EXPORT_DIR, " folder"
        ) from None
    return paths


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def csv_timeline(r: RequestResult) -> TimelineFile:
    """The run's events in the seed's CSV shape; token events numbered so each name is unique."""
    rows, n = [], 0
    for e in r.timeline:
        name = e.name
        if name == "token":
            n += 1
            name, detail = f"token_{n}", f"token {n} id {e.detail}"
        else:
            detail = e.detail
        rows.append(TimelineEvent(name, round(e.t_ms, 3), detail))
    return TimelineFile(tuple(rows))


CLOCKS = (
    "ttft_ms .. itl_ms: wall clock, as a client sees the stream; engine_metrics: the same formulas "
    "with held_ms, the time the run was held at a step (paused or stepped in the explorer), taken out"
)


def metrics_record(r: RequestResult) -> dict:
    """request-metrics.json with the seed calculator's keys, from measured values.

    The seed's keys hold the wall-clock metrics, what a client would have seen; `engine_metrics`
    holds the same keys on the engine's clock (held time taken out) and `held_ms` the time held.
    """
    record: dict = {"scope": "full causal attention; measured on one request; logical unsharded KV"}
    kv, m = r.kv_peak, r.metrics
    if kv is not None:
        record["kv_bytes_per_token"] = kv.bytes_per_token
        record["prompt_kv_mib"] = kv.bytes_per_token * r.usage.prompt_tokens / MIB
        record["stop_kv_mib"] = kv.logical_bytes / MIB
        record["stop_kv_physical_mib"] = kv.physical_bytes / MIB
    if m is not None:
        record["clocks"] = CLOCKS
        record |= _metric_keys(m)
        record["held_ms"] = r.held_ms
        record["engine_metrics"] = None if r.engine_metrics is None else _metric_keys(r.engine_metrics)
    record["input_tokens"] = r.usage.prompt_tokens
    record["finish_reason"] = r.finish_reason
    return record


def _metric_keys(m: RequestMetrics) -> dict:
    keys = {
        "ttft_ms": m.ttft_ms,
        "e2e_ms": m.e2e_ms,
        "tpot_ms": m.tpot_ms,
        "decode_output_tokens_per_second": m.decode_output_tokens_per_second,
        "whole_request_output_tokens_per_second": m.whole_request_output_tokens_per_second,
        "output_tokens": m.output_tokens,
    }
    if m.itl is not None:
        keys["itl_ms"] = m.itl.summary()
    return keys


def perfetto_trace(r: RequestResult) -> dict:
    """Chrome trace-event JSON: stages as spans, tokens as instants (opens in Perfetto)."""
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"reqscope {r.request_id}"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "lifecycle"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "tokens"}},
    ]
    for s in r.stages:
        events.append(
            {
                "name": s.name,
                "cat": "stage",
                "ph": "X",
                "pid": 1,
                "tid": 1,
                "ts": round(s.start_ms * 1000, 1),
                "dur": round(max(s.duration_ms, 0.0) * 1000, 1),
            }
        )
    n = 0
    for e in r.timeline:
        if e.name == "token":
            n += 1
            events.append(
                {
                    "name": f"token {n}",
                    "cat": "token",
                    "ph": "i",
                    "s": "t",
                    "pid": 1,
                    "tid": 2,
                    "ts": round(e.t_ms * 1000, 1),
                    "args": {"token_id": e.detail},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
