"""The KV cache: one bar per layer growing with every token, logical and physical totals, memory."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.kv.arithmetic import KIB, MIB
from minengine.kv.cache import KVUsage
from reqscope.ui.glyphs import bar, columns
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.memory_probe import MemoryReading

_MIN_BAR = 6  # narrower horizontal bars say too little: draw the layers as columns instead


class KVPanel(Panel):
    """Totals on top, then the per-layer bars scaled to each layer's reserved capacity."""

    TITLE = "KV cache"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        kv = frame.view.kv
        if kv is None:
            return Text("the cache fills at prefill", style="dim")
        lines = _totals(kv, width) + [_memory(frame.memory, frame.replay)]
        rows = height - len(lines)
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


def _memory(reading: MemoryReading | None, replay: bool) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis", style="dim")
    if replay or reading is None:
        text.append("process memory: not measured in a replay" if replay else "process memory: –")
        return text
    text.append(f"process RSS {reading.rss_bytes / MIB:.1f} MiB")
    if reading.device_bytes is not None:
        text.append(f" · {reading.device} allocated {reading.device_bytes / MIB:.1f} MiB")
    return text


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
