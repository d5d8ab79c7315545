"""Events to JSON lines and back, so a run can be exported and replayed without a model.

Every event is a frozen dataclass built from other dataclasses, tuples and scalars, so one
generic encoder/decoder driven by the type hints covers them all; a record names its event
type in `"type"`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from minengine.engine import events as ev
from minengine.engine.roofline import ComputeCeiling, FlopShape, ReadCeiling, flop_shape
from minengine.errors import Mention, NotATraceError, ReqscopeError, Setting
from minengine.settings import Settings, SettingValue  # no torch: replaying a trace loads none

if TYPE_CHECKING:
    from minengine.engine.engine import Engine

EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ev.StageEvent,
        ev.PromptEvent,
        ev.AdmitEvent,
        ev.PrefixCacheEvent,
        ev.PrefillEvent,
        ev.TokenEvent,
        ev.StepReady,
        ev.PreemptEvent,
        ev.DoneEvent,
    )
}
HEADER_TYPE = "reqscope-trace"
_EXPORT = Mention(Setting.EXPORT_DIR, every_way=True)  # how a trace is made, for the errors
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TraceHeader:
    """First line of a trace file: what produced it."""

    model: str
    description: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    device: str
    load_ms: float
    weights: str = "float32"  # the projections' format (traces from before it was a choice were float32)
    weights_why: str = ""  # "asked for", "auto: ..."
    # The read ceiling the run's roofline was drawn against (None without one, and in traces
    # recorded before it was kept: readers that predate it skip the key).
    read_ceiling: ReadCeiling | None = None
    kernels: str = "fast"  # `Engine(kernels=...)`: "reference" ran every step through the plain model
    # Every setting the run ran under (`settings_report.collect`); empty in traces recorded before they were kept.
    settings: tuple[SettingValue, ...] = ()
    # Prefill's roofline: the compute ceiling measured for this model's path (None without one)
    # and the model's arithmetic per row (None in traces recorded before it was kept).
    compute_ceiling: ComputeCeiling | None = None
    flop_shape: FlopShape | None = None


def trace_header(
    engine: Engine,
    read_ceiling: ReadCeiling | None = None,
    settings: Settings | None = None,
    compute_ceiling: ComputeCeiling | None = None,
) -> TraceHeader:
    """What a recorded trace says about the engine that ran it (and the ceiling its roofline used), and
    the settings it ran under (`settings`, or gathered now from the engine)."""
    from minengine.record.settings_report import collect_for_engine  # torch's, loaded with the engine

    c = engine.cfg
    settings = collect_for_engine(engine) if settings is None else settings
    return TraceHeader(
        model=str(engine.model_dir),
        description=engine.describe(),
        layers=c.num_hidden_layers,
        q_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=engine.device.type,
        load_ms=engine.load_ms,
        weights=engine.weights.format,
        weights_why=engine.weights.why,
        read_ceiling=read_ceiling,
        kernels=engine.kernels,
        settings=settings.values,
        compute_ceiling=compute_ceiling,
        flop_shape=flop_shape(c, engine.model.decode_weight_bytes),
    )


def encode_value(value):
    """A dataclass (and what it holds) as plain JSON values, field by field."""
    if dataclasses.is_dataclass(value):
        return {f.name: encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [encode_value(v) for v in value]
    return value


def event_record(event) -> dict:
    """A JSON-ready record of one event."""
    return {"type": type(event).__name__} | encode_value(event)


@cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def decode_value(tp, value):
    """`value` (from `encode_value`) rebuilt as type `tp`, led by the type hints."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return decode_value(options[0], value) if len(options) == 1 else value
    if origin is tuple:
        args = typing.get_args(tp)
        if args and args[-1] is not Ellipsis and len(args) == len(value):  # a fixed shape: (token id, bias)
            return tuple(decode_value(a, v) for a, v in zip(args, value, strict=True))
        inner = args[0] if args else object
        return tuple(decode_value(inner, v) for v in value)
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        fields = (f.name for f in dataclasses.fields(tp) if f.name in value)
        return tp(**{name: decode_value(hints[name], value[name]) for name in fields})
    if tp is float and isinstance(value, int):
        return float(value)
    return value


def event_from_record(record: dict):
    """Rebuild an event from `event_record` output."""
    cls = EVENT_TYPES.get(record.get("type", ""))
    if cls is None:
        raise ReqscopeError(f"unknown event type {record.get('type')!r} in trace")
    return decode_value(cls, record)


def write_trace(path: Path, header: TraceHeader, events: Iterable) -> None:
    """Write a header line and one line per event."""
    with path.open("w", encoding="utf-8") as out:
        out.write(json.dumps({"type": HEADER_TYPE, "version": FORMAT_VERSION} | encode_value(header)) + "\n")
        for event in events:
            out.write(json.dumps(event_record(event), ensure_ascii=False) + "\n")


def read_trace(path: str | Path) -> tuple[TraceHeader, list]:
    """Read a trace written by `write_trace`; one-line errors for anything else."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ReqscopeError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise NotATraceError(
            f"{path} is not a reqscope trace (not UTF-8 text at byte {exc.start}); export one with ", _EXPORT
        ) from None
    records = list(_parse(path, lines))
    if not records or records[0].get("type") != HEADER_TYPE:
        raise NotATraceError(f"{path} is not a reqscope trace (export one with ", _EXPORT, ")")
    try:
        header = decode_value(TraceHeader, records[0])
    except (KeyError, TypeError, ValueError) as exc:
        raise NotATraceError(f"{path} has a malformed header ({exc}); was it written by another version?") from None
    try:
        return header, [event_from_record(r) for r in records[1:]]
    except (KeyError, TypeError) as exc:
        raise ReqscopeError(f"{path} has a malformed event ({exc}); was it written by another version?") from None


def _parse(path: Path, lines: list[str]) -> Iterator[dict]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise NotATraceError(f"{path}:{n} is not valid JSON ({exc.msg}); is it a reqscope trace?") from None
        if not isinstance(record, dict):
            raise NotATraceError(f"{path}:{n} is not a JSON object; is it a reqscope trace?")
        yield record
