"""Client-observed latency: TTFT, ITL per chunk, TPOT per token, rates, E2E, and the server's TTFT beside it."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.endpoint.events import EndpointResult
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.glyphs import ms
from reqscope.ui.panel import Panel
from reqscope.ui.panels.latency import itl_chart, metric_figures, pairs


class EndpointLatencyPanel(Panel[EndpointFrame]):
    """The client's figures, the client-vs-server TTFT split when the server reports one, the ITL chart."""

    TITLE = "Latency (client clock)"
    WAITING = "sending…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        m = view.metrics()
        itl = m.itl if m is not None else None
        gaps = view.itls_ms()
        figures = metric_figures(m, itl, gaps[-1] if gaps else None)
        tokens, source = view.output_tokens()
        note = Text(no_wrap=True, overflow="ellipsis", style="dim")
        note.append(f"ITL per chunk ({len(view.chunks)}), TPOT per token ({tokens}, from {source})")
        lines = [*pairs(figures, width), note, *_server_lines(view.result, width)]
        lines += itl_chart(tuple(gaps), width, height - len(lines), unit="chunks")
        return Group(*lines[: max(height, 1)])


def _server_lines(result: EndpointResult | None, width: int) -> list[Text]:
    """Client TTFT against the server's own, and where the difference went."""
    if result is None:
        return [Text("server's view: once the stream ends (reqscope serve reports it)", style="dim", no_wrap=True,
                     overflow="ellipsis")]
    t = result.ttft
    if t is None:
        why = "the server sent no timing report" if result.server is None else "no first token to compare"
        return [Text(f"server's view: {why} (reqscope serve sends one)", style="dim", no_wrap=True,
                     overflow="ellipsis")]
    heading = Text("TTFT: client clock vs server clock", style="dim underline", no_wrap=True,
                   overflow="ellipsis")
    figures = [
        ("client", ms(t.client_ms)),
        ("server", ms(t.server_ms)),
        ("outside", ms(t.outside_server_ms)),
        ("gateway", ms(t.gateway_ms)),
        ("queue", ms(t.queue_ms)),
        ("prefill", ms(t.prefill_ms)),
    ]
    note = Text("outside the server: connection, network, HTTP (the client's clock only)", style="dim",
                no_wrap=True, overflow="ellipsis")
    return [heading, *pairs(figures, width), note]
