"""The batch around the request on a real server: its `/metrics` (and llama-server's `/slots`), poll by poll.

The same panel id as the engine explorer's batch panel ("batch", key 6): there the engine's own
steps say who shared them; here the server's gauges and counters do, each line naming its
source and the poll's cost. Each ITL spike is marked with what the batch did around it.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.endpoint.server.reconcile import spike_marks
from reqscope.endpoint.server.records import BatchSample
from reqscope.endpoint.server.words import batch_change, peaks
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.glyphs import sparkline
from reqscope.ui.panel import Panel


class EndpointBatchPanel(Panel[EndpointFrame]):
    """Running, waiting, KV use and preemptions as the server reports them; slots; ITL spikes and their cause."""

    TITLE = "Batch (the server's /metrics)"
    WAITING = "reading the server's batch…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        samples = view.batch
        lines: list[Text] = []
        if not samples:
            lines.append(_dim(_nothing_yet(frame)))
        else:
            first, last = samples[0], samples[-1]
            lines.append(_line(f"now: {_now(last)}"))
            lines.append(_dim(f"during the request: {batch_change(first, last)}; {peaks(tuple(samples))}"))
            if last.slots:
                lines.append(_line("slots: " + "  ".join(_slot(s) for s in last.slots)))
            lines += _sparks(samples, width)
            cost = sum(s.poll_ms for s in samples) / len(samples)
            every = frame.poll_ms
            lines.append(_dim(f"{last.source} every {every:.0f} ms: {len(samples)} reads, {cost:.1f} ms each "
                              "(client clock, beside the stream)"))
        marks = spike_marks([c.t_ms for c in view.chunks], samples)
        room = max(height - len(lines), 0)
        for mark in marks[max(len(marks) - room, 0):] if room else []:  # the newest spikes that fit
            ratio = mark.itl_ms / mark.median_ms
            lines.append(_line(f"ITL spike, chunk {mark.chunk}: {mark.itl_ms:.0f} ms ({ratio:.1f}x median) · "
                               f"{mark.reason}", "yellow"))
        server = view.server
        if server is not None:
            lines += [_dim(o.line()) for o in server.off if o.flag in ("--metrics", "--no-slots")]
        return Group(*lines[: max(height, 1)])


def _nothing_yet(frame: EndpointFrame) -> str:
    if frame.poll_ms <= 0:
        return "not read: --poll-ms 0"
    server = frame.view.server
    if server is not None and server.kind.name not in ("vllm", "llama-server"):
        return f"{server.kind.name} server: its batch is not readable (vLLM and llama-server expose one)"
    return "no reading yet"


def _now(s: BatchSample) -> str:
    parts = []
    if s.running is not None:
        parts.append(f"running {s.running:.0f}")
    if s.waiting is not None:
        parts.append(f"waiting {s.waiting:.0f}")
    if s.kv_usage is not None:
        parts.append(f"KV {s.kv_usage:.1%}")
    if s.busy_slots_per_decode is not None:
        parts.append(f"busy slots/decode {s.busy_slots_per_decode:.2f}")
    return " · ".join(parts) or "no figures"


def _slot(slot) -> str:
    if not slot.processing:
        return f"{slot.id}:idle"
    decoded = f" {slot.decoded} out" if slot.decoded is not None else ""
    return f"{slot.id}:task {slot.task}{decoded}"


def _sparks(samples: list[BatchSample], width: int) -> list[Text]:
    lines = []
    room = max(width - 10, 4)
    series = (("running", [s.running for s in samples]), ("waiting", [s.waiting for s in samples]),
              ("KV %", [None if s.kv_usage is None else 100 * s.kv_usage for s in samples]))
    for name, values in series:
        known = [v for v in values if v is not None]
        if len(known) >= 2:
            line = Text(no_wrap=True, overflow="crop")
            line.append(f"{name:<8}", style="dim")
            line.append(sparkline(known, room))
            line.append(f" {max(known):.0f}", style="dim")
            lines.append(line)
    return lines


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _dim(text: str) -> Text:
    return _line(text, "dim")
