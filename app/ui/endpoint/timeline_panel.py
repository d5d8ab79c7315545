"""The client's timeline, event by event, and the server's stages when it reports them.

Client events are on the client's clock from the send; a server's stages are on its own clock
from the moment its handler saw the request, so the two columns are never subtracted from each
other, only their spans compared (that is the latency panel's TTFT split). vLLM's span is the
exception: its times are wall-clock times, so its moments are placed on the client's clock.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.timeline import TimelineEvent
from reqscope.endpoint.events import ServerReport, ServerTimings
from reqscope.endpoint.server.records import ServerView
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.endpoint.view import EndpointView
from reqscope.ui.panel import Panel


class EndpointTimelinePanel(Panel[EndpointFrame]):
    """Client events with times and gaps (the per-chunk `token` events folded into one row), then the server's."""

    TITLE = "Timeline"
    WAITING = "sending…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        lines = [Text(f"{'client event':<22}{'t ms':>10}{'+ms':>9}  detail", style="dim underline", no_wrap=True)]
        previous = 0.0
        for event in client_events(view):
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(f"{event.name:<22}", style="bold")
            line.append(f"{event.t_ms:>10.2f}{event.t_ms - previous:>9.2f}  ")
            line.append(event.detail, style="dim")
            lines.append(line)
            previous = event.t_ms
        result = view.result
        server = view.server
        if server is not None and (server.span is not None or server.vllm_metrics is not None):
            lines += _vllm(server)
        else:
            lines += _server(result.server if result else None, result.timings if result else None, view.done)
        if frame.new_connection:
            lines.append(Text("--new-connection: each request opens (and pays for) its own connection", style="dim",
                              no_wrap=True, overflow="ellipsis"))
        return Group(*lines[: max(height, 1)])


def client_events(view: EndpointView) -> list[TimelineEvent]:
    """The client's timeline so far, with the chunks' `token` events folded into one row."""
    if view.result is not None:
        events = list(view.result.timeline)
    else:
        events = []
        if view.sent is not None:
            events.append(TimelineEvent("client_send", view.sent.t_ms, view.sent.url))
        if view.connection is not None:
            c = view.connection
            name, detail = ("connection_reused", "kept alive") if c.reused else (
                "connection_new", f"opened in {c.connect_ms or 0:.2f} ms")
            events.append(TimelineEvent(name, c.t_ms, detail))
        if view.response is not None:
            events.append(TimelineEvent("first_byte", view.response.t_ms, f"HTTP {view.response.status}"))
        if view.chunks:
            events.append(TimelineEvent("first_visible_token", view.chunks[0].t_ms, "chunk 0"))
            events += [TimelineEvent("token", c.t_ms) for c in view.chunks]
    tokens = [e for e in events if e.name == "token"]
    folded = [e for e in events if e.name != "token"]
    if len(tokens) > 1:
        row = TimelineEvent(f"token × {len(tokens)}", tokens[-1].t_ms, f"one per chunk, last at {tokens[-1].t_ms:.2f}")
        at = next((i for i, e in enumerate(folded) if e.t_ms > tokens[-1].t_ms or e.name == "last_visible_token"),
                  len(folded))
        folded.insert(at, row)
    return sorted(folded, key=lambda e: e.t_ms)


def _vllm(view: ServerView) -> list[Text]:
    """vLLM's view: its span's moments placed on the client's clock (both are wall clocks on one
    machine, and the client's origin is its send), or else its per-request durations."""
    span = view.span
    if span is None:
        m = view.vllm_metrics
        lines = [Text(""), Text(f"{'server stage':<22}{'ms':>10}  own clock (vLLM per-request metrics)",
                                style="dim underline", no_wrap=True, overflow="ellipsis")]
        for name, value in (("queue", m.queue_time_ms), ("prefill (from schedule)", m.time_to_first_token_ms),
                            ("generation", m.generation_time_ms)):
            if value is not None:
                lines.append(Text(f"{name:<22}{value:>10.2f}", no_wrap=True, overflow="ellipsis"))
        return lines
    arrival = span.start_unix_ms - view.send_unix_ms
    api = view.ttft_split.server_api_ms if view.ttft_split is not None else None
    moments = [("server arrival", arrival, "vLLM's API has the request")]
    if api is not None:
        moments.append(("server queued", arrival + api, "template and tokens done"))
        if span.queue_ms is not None:
            moments.append(("server scheduled", arrival + api + span.queue_ms, "prefill starts"))
    if span.ttft_ms is not None:
        moments.append(("server first token", arrival + span.ttft_ms, ""))
    if span.e2e_ms is not None:
        moments.append(("server end", arrival + span.e2e_ms, ""))
    lines = [Text(""), Text(f"{'server event':<22}{'t ms':>10}{'+ms':>9}  vLLM span, on the client's clock",
                            style="dim underline", no_wrap=True, overflow="ellipsis")]
    previous = 0.0
    for name, t, detail in moments:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{name:<22}", style="bold")
        line.append(f"{t:>10.2f}{t - previous:>9.2f}  ")
        line.append(detail, style="dim")
        lines.append(line)
        previous = t
    return lines


def _server(report: ServerReport | None, timings: ServerTimings | None, done: bool) -> list[Text]:
    """The server's stages: reqscope serve's, or the two llama.cpp's timings name (prompt, generation)."""
    if report is None and timings is None:
        note = "server stages: none reported (reqscope serve and llama.cpp's server send them)" if done else (
            "server stages: with the last chunk, when the server reports them")
        return [Text(""), Text(note, style="dim", no_wrap=True, overflow="ellipsis")]
    source = "own clock" if report is not None else "own clock (llama.cpp timings)"
    lines = [Text(""), Text(f"{'server stage':<22}{'ms':>10}  {source}", style="dim underline", no_wrap=True,
                            overflow="ellipsis")]
    if report is not None:
        for name, value in report.stages_ms:
            lines.append(Text(f"{name:<22}{value:>10.2f}", no_wrap=True))
        return lines
    assert timings is not None
    for name, value, tokens in (("prompt", timings.prompt_ms, timings.prompt_n),
                                ("generation", timings.predicted_ms, timings.predicted_n)):
        if value is not None:
            detail = "" if tokens is None else f"  {tokens} tokens"
            lines.append(Text(f"{name:<22}{value:>10.2f}{detail}", no_wrap=True))
    return lines
