"""The lifecycle as a strip: each stage with its measured duration, the current one lit."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.events import PrefixCacheEvent
from reqscope.ui.glyphs import duration_text, fit_cell
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame

# Stage names too long for a cell, longest first: the first that fits is drawn.
_LABELS = {"prefix_cache": ("prefix cache", "pfx cache", "cache")}


class PipelinePanel(Panel):
    """Two lines: stage names, then durations; pending stages dim, the running one reversed."""

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        view = frame.view
        current = view.current_stage()
        pipeline = view.pipeline()
        cell = max(width // len(pipeline), 6)
        names, times = Text(no_wrap=True), Text(no_wrap=True)
        for name in pipeline:
            duration = view.stage_ms(name)
            finished = name in view.stages or (name == "stream" and view.done and duration is not None)
            if name == current or (name == "stream" and current == "decode" and duration is not None):
                style = "bold reverse"
            elif finished:
                style = "bold"
            else:
                style = "dim"
            names.append(fit_cell(stage_label(name, cell), cell), style=style)
            shown = "" if duration is None else duration_text(duration)
            if name == "prefix_cache" and duration is not None:
                shown = prefix_cache_cell(shown, view.prefix_cache, view.stage_detail(name), cell)
            times.append(fit_cell(shown, cell), style="" if style == "bold" else style)
        return Group(names, times)


def stage_label(name: str, cell: int) -> str:
    """A stage's name as the strip spells it in a cell `cell` wide (one leading space)."""
    labels = _LABELS.get(name, (name,))
    return next((label for label in labels if len(label) < cell), labels[-1])


def prefix_cache_cell(duration: str, event: PrefixCacheEvent | None, detail: str, cell: int) -> str:
    """The prefix cache stage's second line: its duration and the blocks hit, as much as fits.

    "3.4ms 21/21 hit", "3.4ms 21/21", or the duration alone; "off" when the cache is off.
    """
    if detail == "off" or (event is not None and not event.enabled):
        return f"{duration} off" if len(duration) + 4 < cell else "off"
    if event is None:
        return duration
    hit = f"{event.blocks_hit}/{event.blocks_looked_up}"
    for shown in (f"{duration} {hit} hit", f"{duration} {hit}", duration):
        if len(shown) < cell:
            return shown
    return duration
