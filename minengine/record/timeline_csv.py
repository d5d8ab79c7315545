"""The request-timeline CSV: one row per named event, `event,time_ms,detail`.

Example:

    event,time_ms,detail
    client_send,0,request leaves the client
    first_visible_token,190,token 1 of 150
    last_visible_token,3915,token 150 of 150

Any events may appear (server_arrival, scheduler_admit, ...), each at most once; the three in
REQUIRED_EVENTS must be present and in time order, because every request metric derives from
them. Reading rejects anything else with a one-line TimelineFileError.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from minengine.engine.metrics import MetricsInputError
from minengine.engine.timeline import TimelineEvent

HEADER = ("event", "time_ms", "detail")
SEND, FIRST_TOKEN, LAST_TOKEN = "client_send", "first_visible_token", "last_visible_token"
REQUIRED_EVENTS = (SEND, FIRST_TOKEN, LAST_TOKEN)


class TimelineFileError(MetricsInputError):
    """A timeline CSV that is missing, malformed or describes an impossible request."""


@dataclass(frozen=True)
class TimelineFile:
    """A request's events in file order; construction enforces the rules in the module doc.

    A row's `event` column is its event's `name`, its `time_ms` column the event's `t_ms`.
    """

    events: tuple[TimelineEvent, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for item in self.events:
            if not item.name:
                raise TimelineFileError("an event has an empty name")
            if item.name in seen:
                raise TimelineFileError(f"event {item.name!r} appears more than once")
            if not math.isfinite(item.t_ms):
                raise TimelineFileError(f"event {item.name!r} has time_ms={item.t_ms}")
            seen.add(item.name)
        missing = [name for name in REQUIRED_EVENTS if name not in seen]
        if missing:
            raise TimelineFileError(f"timeline lacks required event(s): {', '.join(missing)}")
        s, f, e = (self.time_of(name) for name in REQUIRED_EVENTS)
        if not s <= f <= e:
            raise TimelineFileError(
                f"times out of order: need {SEND} <= {FIRST_TOKEN} <= {LAST_TOKEN}, "
                f"got {s:g} / {f:g} / {e:g} ms"
            )

    def time_of(self, event: str) -> float:
        """Timestamp of a named event (KeyError if absent)."""
        for item in self.events:
            if item.name == event:
                return item.t_ms
        raise KeyError(event)

    @property
    def send_ms(self) -> float:
        """When the client sent the request."""
        return self.time_of(SEND)

    @property
    def first_token_ms(self) -> float:
        """When the first visible output arrived."""
        return self.time_of(FIRST_TOKEN)

    @property
    def last_token_ms(self) -> float:
        """When the last visible output arrived."""
        return self.time_of(LAST_TOKEN)


def parse_timeline(text: str, source: str = "timeline") -> TimelineFile:
    """Parse CSV text; `source` names the input in error messages."""
    reader = csv.DictReader(io.StringIO(text))
    columns = [name.strip() for name in reader.fieldnames or []]
    missing = [name for name in HEADER[:2] if name not in columns]
    if missing:
        raise TimelineFileError(
            f"{source}: header must contain {','.join(HEADER)}; missing {', '.join(missing)}"
        )
    reader.fieldnames = columns
    events = []
    # Data rows start on line 2, after the header.
    for line, row in enumerate(reader, start=2):
        name = (row.get("event") or "").strip()
        raw_time = (row.get("time_ms") or "").strip()
        try:
            time_ms = float(raw_time)
        except ValueError:
            raise TimelineFileError(
                f"{source} line {line}: time_ms {raw_time!r} of event {name!r} is not a number"
            ) from None
        events.append(TimelineEvent(name, time_ms, (row.get("detail") or "").strip()))
    try:
        return TimelineFile(tuple(events))
    except TimelineFileError as exc:
        raise TimelineFileError(f"{source}: ", exc.message) from None


def read_timeline(path: str | Path) -> TimelineFile:
    """Read and validate a timeline CSV file."""
    path = Path(path)
    try:
        # utf-8-sig: spreadsheet exports often start with a byte-order mark.
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise TimelineFileError(f"no timeline file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TimelineFileError(f"cannot read {path}: {exc}") from None
    return parse_timeline(text, source=str(path))


def format_timeline(timeline: TimelineFile) -> str:
    """The CSV text for a timeline, header included."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER)
    for item in timeline.events:
        writer.writerow((item.name, _format_time(item.t_ms), item.detail))
    return out.getvalue()


def write_timeline(path: str | Path, timeline: TimelineFile) -> None:
    """Write a timeline CSV that read_timeline reads back unchanged."""
    Path(path).write_text(format_timeline(timeline), encoding="utf-8")


def _format_time(time_ms: float) -> str:
    # Whole milliseconds print without a trailing ".0"; repr keeps every other float exact.
    return str(int(time_ms)) if time_ms.is_integer() else repr(time_ms)
