"""The client's TTFT as one bar, split by what the server reports (`reqscope.endpoint.server.reconcile`)."""

from __future__ import annotations

from rich.text import Text

from reqscope.endpoint.server.records import TtftSplit
from reqscope.endpoint.server.words import api_note, split_parts

_STYLE = {
    "connection + HTTP": "blue",
    "outside the server": "blue",
    "queue": "yellow",
    "prefill + first token": "green",
    "delivery": "magenta",
}


def ttft_bar(split: TtftSplit, width: int) -> list[Text]:
    """The bar (each segment as wide as its share of TTFT), a legend with each part's milliseconds,
    the source, and the clocks' disagreement when there is one."""
    parts = [(name, max(value, 0.0)) for name, value in split_parts(split) if value is not None]
    total = max(split.client_ttft_ms, sum(v for _, v in parts), 1e-9)
    width = max(width, 10)
    bar = Text(no_wrap=True, overflow="crop")
    used = 0
    for i, (name, value) in enumerate(parts):
        cells = width - used if i == len(parts) - 1 else round(width * value / total)
        cells = max(0, min(cells, width - used))
        bar.append("█" * cells, style=_STYLE[name])
        used += cells
    legend = Text()  # wraps: each part's figure stays readable in a narrow panel
    for i, (name, value) in enumerate(parts):
        legend.append(" · " if i else "")
        legend.append("■ ", style=_STYLE[name])
        legend.append(f"{name} {value:.1f} ms".replace(" ", "\u00a0"))  # an entry never breaks across lines
    head = Text(no_wrap=True, overflow="ellipsis", style="dim underline")
    head.append(f"TTFT {split.client_ttft_ms:.1f} ms (client) split by the server: {split.source}")
    lines = [head, bar, legend]
    if split.server_api_ms is not None:
        note = api_note(split).removeprefix("; ")
        lines.append(Text(note[:1].upper() + note[1:], style="dim", no_wrap=True, overflow="ellipsis"))
    if split.joined:
        lines.append(Text("connection, HTTP and delivery are one figure: the server gives durations, not times",
                          style="dim", no_wrap=True, overflow="ellipsis"))
    if split.clock_note:
        lines.append(Text(f"! {split.clock_note}", style="bold yellow", no_wrap=True, overflow="ellipsis"))
    return lines
