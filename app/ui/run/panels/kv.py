"""The KV cache: totals, its blocks by who else holds them, memory, its growth over the request
as a chart, and one bar per layer.

The growth chart draws MiB against cached tokens: this run measured (logical, and physical as
the staircase its blocks make), the layouts it did not use by formula (dotted), and the same
request measured in the other layout once `m` has run it.
"""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.events import PrefixCacheEvent
from minengine.kv.arithmetic import KIB, MIB
from minengine.kv.usage import BlockSharing, KVUsage
from reqscope.ui.glyphs import PlotSeries, bar, columns, plot
from reqscope.ui.panel import Panel
from reqscope.ui.run.figures.kv_growth import KVPoint, growth_points
from reqscope.ui.run.figures.layout_compare import formula_rows
from reqscope.ui.run.figures.memory_probe import MemoryReading
from reqscope.ui.run.frame import Frame

_MIN_BAR = 6  # narrower horizontal bars say too little: draw the layers as columns instead
_CHART_MIN_ROWS = 5  # a legend, three rows of plot, the token axis
_BOTH_FROM_ROWS = 10  # from this many free rows the growth chart and the per-layer bars share the panel
_LAYOUT_STYLE = {"gqa": "green", "mha": "red", "mqa": "blue"}
_HEADROOM = 1.2  # the plot's top, over this run's physical bytes: room above the last step


class KVPanel(Panel):
    """Totals, the growth chart when there is room, then the per-layer bars scaled to their reserved capacity."""

    TITLE = "KV cache"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        kv = frame.view.kv
        if kv is None:
            return Text("the cache fills at prefill", style="dim")
        lines = _totals(kv, width) + [_memory(frame.memory, frame.replay)]
        # Who holds the blocks now comes before what the prefix cache gave at admission.
        extra = [line for line in (block_split_line(kv.sharing, width), shared_blocks_line(frame.view.prefix_cache, kv))
                 if line is not None]  # fmt: skip
        lines[2:2] = extra[: max(height - len(lines), 0)]
        rows = height - len(lines)
        if rows >= _CHART_MIN_ROWS:
            # Short of room for both, the chart goes first: every layer holds the same tokens, so
            # the bars repeat one figure, while the chart shows how the request got there.
            chart = growth_chart(frame, kv, width, rows if rows < _BOTH_FROM_ROWS else max(6, rows // 2))
            lines += chart
            rows -= len(chart)
        if rows >= 2:
            lines += _bars(kv, width, rows)
        return Group(*lines)


def _totals(kv: KVUsage, width: int) -> list[Text]:
    first = Text(no_wrap=True, overflow="ellipsis")
    first.append(f"{kv.layout.upper()} ", style="bold")
    first.append(
        f"{kv.layers} layers × {kv.stored_heads} heads × {kv.head_dim} · {kv.dtype} · "
        f"{kv.bytes_per_token / KIB:.1f} KiB/token"
    )
    second = Text(no_wrap=True, overflow="ellipsis")
    second.append(f"{kv.tokens} tokens ", style="bold")
    second.append(f"logical {kv.logical_bytes / MIB:.3f} MiB", style="bold green")
    second.append(" · ")
    second.append(f"physical {kv.physical_bytes / MIB:.3f} MiB", style="bold")
    second.append(f" ({kv.blocks} blocks of {kv.block_size})")
    if width >= 70:
        second.append(f" · reserved {kv.reserved_bytes / MIB:.2f} MiB", style="dim")
    return [first, second]


def shared_blocks_line(event: PrefixCacheEvent | None, kv: KVUsage) -> Text | None:
    """This request's blocks: how many came from the prefix cache (shared) and how many it filled (new).

    None before the prefix cache stage, in older traces, and with the cache off.
    """
    if event is None or not event.enabled:
        return None
    shared = min(event.blocks_hit, kv.blocks)
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("blocks ", style="dim")
    text.append(f"{shared} shared", style="bold green" if shared else "bold")
    text.append(" (from the prefix cache)" if shared else " (no prefix cache hit)", style="dim")
    text.append(f" + {kv.blocks - shared} new", style="bold")
    text.append(f" · {event.blocks_hit}/{event.blocks_looked_up} hit, copied in {event.copy_ms:.1f} ms"
                f" · the cache keeps {event.kept_blocks} blocks, {event.kept_bytes / MIB:.1f} MiB", style="dim")
    return text


# The pool bar's colours (the batch panel): this request's blocks, other requests', the prefix cache's.
_HOLDER_STYLES = ("bold green", "yellow", "blue")
_SPLIT_WORDINGS = (
    ("own", "shared with other requests", "with the prefix cache"),
    ("own", "with requests", "with prefix cache"),
    ("own", "others", "prefix"),  # the pool legend's words (the batch panel)
)


def block_split_line(sharing: BlockSharing | None, width: int) -> Text | None:
    """The request's blocks now: its own, shared with other requests, shared with the prefix cache.

    With their MiB where `width` has room, else in shorter words. None for a cache outside the
    pool and in traces recorded before the split was kept.
    """
    if sharing is None:
        return None
    attempts = [(_SPLIT_WORDINGS[0], True)] + [(words, False) for words in _SPLIT_WORDINGS]
    for words, with_bytes in attempts:
        text = _split_text(sharing, words, with_bytes)
        if text.cell_len <= width:
            return text
    text.truncate(width, overflow="ellipsis")
    return text


def _split_text(sharing: BlockSharing, words: tuple[str, str, str], with_bytes: bool) -> Text:
    groups = ((sharing.own, sharing.own_bytes), (sharing.with_requests, sharing.with_requests_bytes),
              (sharing.with_prefix, sharing.with_prefix_bytes))  # fmt: skip
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("blocks ", style="dim")
    text.append(f"{sharing.blocks}", style="bold")
    text.append(": ")
    for n, ((count, nbytes), word, style) in enumerate(zip(groups, words, _HOLDER_STYLES, strict=True)):
        if n:
            text.append(" · ", style="dim")
        text.append(f"{count} ", style=style if count else "bold")
        text.append(word, style="" if count else "dim")
        if with_bytes and count:
            text.append(f" ({nbytes / MIB:.2f} MiB)", style="dim")
    return text


def _memory(reading: MemoryReading | None, replay: bool) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis", style="dim")
    if replay or reading is None:
        text.append("process memory: not measured in a replay" if replay else "process memory: –")
        return text
    text.append(f"process RSS {reading.rss_bytes / MIB:.1f} MiB")
    if reading.device_bytes is not None:
        text.append(f" · {reading.device} allocated {reading.device_bytes / MIB:.1f} MiB")
    return text


def growth_chart(frame: Frame, kv: KVUsage, width: int, rows: int) -> list[Text]:
    """KV MiB against cached tokens in `rows` lines: a legend, the plot, the token axis.

    The height is scaled to this run, so its block staircase shows; a larger layout's line
    leaves the plot at the top, marked ↑ in the legend (its size is in the GQA vs MHA panel).
    """
    own = frame.measured.get(kv.layout)
    points = own.growth if own is not None and own.request_id == frame.request_id and own.growth else (
        growth_points(frame.view))
    others = [(layout, m.growth) for layout, m in sorted(frame.measured.items()) if layout != kv.layout and m.growth]
    formulas = [row for row in formula_rows(frame.header, kv) if row.heads != kv.stored_heads]
    x_max = max([points[-1].tokens] + [g[-1].tokens for _, g in others])
    y_max = points[-1].physical_bytes * _HEADROOM / MIB
    if x_max <= 0 or y_max <= 0:
        return []

    def measured(line: tuple[KVPoint, ...], style: str, physical: bool) -> PlotSeries:
        ys = [(p.physical_bytes if physical else p.logical_bytes) / MIB for p in line]
        return PlotSeries([p.tokens for p in line], ys, style, step=physical)

    def straight(bytes_per_token: int, style: str) -> PlotSeries:
        return PlotSeries((0, x_max), (0, bytes_per_token * x_max / MIB), style, dotted=True)

    own_style = _LAYOUT_STYLE.get(kv.layout, "green")
    # Drawn in order, the later on top where they share a cell: the formulas, the other layout's
    # run, then this run's own layout from the origin (the prompt's part came in one prefill),
    # its physical staircase and its logical line.
    series = [straight(row.bytes_per_token, _LAYOUT_STYLE.get(row.name.lower(), "")) for row in formulas]
    series += [measured(g, _LAYOUT_STYLE.get(layout, ""), physical=True) for layout, g in others]
    series += [straight(kv.bytes_per_token, own_style), measured(points, "yellow", physical=True),
               measured(points, f"bold {own_style}", physical=False)]

    def off_top(name: str, end_bytes: float) -> str:
        return f"{name}↑" if end_bytes / MIB > y_max else name

    legend = _legend(kv, [off_top(row.name, row.bytes_per_token * x_max) for row in formulas],
                     [off_top(layout, g[-1].physical_bytes) for layout, g in others], own_style, width)
    top = f"{y_max:.3g}"
    gutter = len(top) + 1
    plot_rows = max(rows - 2, 1)
    grid = plot(series, max(width - gutter, 1), plot_rows, x_max, y_max)
    lines = [legend]
    for n, row in enumerate(grid):
        label = top if n == 0 else "0" if n == plot_rows - 1 else ""
        line = Text(f"{label:>{gutter - 1}}{'┤' if label else '│'}", style="dim", no_wrap=True)
        lines.append(line + row)
    axis = Text(" " * gutter + "0", style="dim", no_wrap=True)
    end = f"{x_max} tokens"
    prompt = frame.view.prefill.prompt_tokens if frame.view.prefill else None
    if prompt is not None:  # where prefill left the cache: the measured lines start there
        at = gutter + round(prompt / x_max * (2 * (width - gutter) - 1)) // 2
        mark = f"↑{prompt} prompt"
        if at > len(axis.plain) and at + len(mark) + 1 + len(end) <= width:
            axis.append(" " * (at - len(axis.plain)) + mark)
    axis.append(end.rjust(width - len(axis.plain)))
    lines.append(axis)
    return lines


def _legend(kv: KVUsage, formulas: list[str], others: list[str], own_style: str, width: int) -> Text:
    """What each line is, in the longest wording that fits `width`."""
    wordings = (
        ("MiB by cached tokens: ", f"{kv.layout} logical", f"physical, blocks of {kv.block_size}", " formula",
         "measured"),
        ("MiB: ", f"{kv.layout} logical", f"physical ({kv.block_size}-token blocks)", "", "run"),
        ("MiB: ", kv.layout, "blocks", "", "run"),
    )
    for intro, logical, physical, by_formula, measured in wordings:
        legend = Text(no_wrap=True, overflow="ellipsis")
        legend.append(intro, style="dim")
        legend.append(f"━ {logical} ", style=own_style)
        legend.append(f"━ {physical}", style="yellow")
        for name in formulas:
            legend.append(f" ┄ {name}", style=_LAYOUT_STYLE.get(name.rstrip("↑").lower(), ""))
        if formulas and by_formula:
            legend.append(by_formula, style="dim")
        for layout in others:
            legend.append(f" ━ {layout} {measured}", style=_LAYOUT_STYLE.get(layout.rstrip("↑"), ""))
        if legend.cell_len <= width:
            break
    legend.truncate(width, overflow="ellipsis")
    return legend


def _layer_fractions(kv: KVUsage) -> list[tuple[float, float]]:
    """(logical, physical) share of each layer's reserved bytes."""
    per_layer = kv.reserved_bytes / kv.layers if kv.reserved_bytes else 0
    if per_layer <= 0:
        per_layer = max(kv.per_layer_physical_bytes, default=1) or 1
    return [
        (lo / per_layer, ph / per_layer)
        for lo, ph in zip(kv.per_layer_logical_bytes, kv.per_layer_physical_bytes, strict=True)
    ]


def _bars(kv: KVUsage, width: int, rows: int) -> list[Text]:
    fractions = _layer_fractions(kv)
    caption = Text("MiB per layer; ░ = block rounding", style="dim", no_wrap=True,
                   overflow="ellipsis")
    per_line = math.ceil(len(fractions) / (rows - 1))
    cell = width // per_line
    bar_width = cell - 12  # "L00 " + bar + " 0.000 "
    if bar_width >= _MIN_BAR:
        return [caption, *_horizontal(kv, fractions, rows - 1, cell, bar_width)]
    return _vertical(fractions, width, rows)


def _horizontal(kv: KVUsage, fractions, rows: int, cell: int, bar_width: int) -> list[Text]:
    lines = [Text(no_wrap=True) for _ in range(min(rows, len(fractions)))]
    for layer, (logical, physical) in enumerate(fractions):
        line = lines[layer % len(lines)]
        filled = bar(logical, bar_width).rstrip()
        padding = bar(physical, bar_width).rstrip()[len(filled) :]
        line.append(f"L{layer:02d} ", style="dim")
        line.append(filled, style="green")
        line.append("░" * len(padding), style="green dim")
        line.append(" " * (bar_width - len(filled) - len(padding)))
        line.append(f" {kv.per_layer_logical_bytes[layer] / MIB:.3f} ".ljust(cell - bar_width - 4))
    return lines


def _vertical(fractions, width: int, rows: int) -> list[Text]:
    """Layers as columns, bottom-up, with an axis line naming the first and last layer."""
    step = 2 if len(fractions) * 2 <= width else 1
    grid = [Text(line, style="green", no_wrap=True) for line in columns([lo for lo, _ in fractions], rows - 1, step)]
    axis = f"L0{'─' * max(len(fractions) * step - 2 - len(str(len(fractions) - 1)) - 1, 0)}L{len(fractions) - 1}"
    grid.append(Text(axis, style="dim", no_wrap=True))
    return grid
