"""The lifecycle as a strip: each stage with its measured duration, the current one lit."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.view import PIPELINE


class PipelinePanel(Panel):
    """Two lines: stage names, then durations; pending stages dim, the running one reversed."""

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        view = frame.view
        current = view.current_stage()
        cell = max(width // len(PIPELINE), 6)
        names, times = Text(no_wrap=True), Text(no_wrap=True)
        for name in PIPELINE:
            duration = view.stage_ms(name)
            finished = name in view.stages or (name == "stream" and view.done and duration is not None)
            if name == current or (name == "stream" and current == "decode" and duration is not None):
                style = "bold reverse"
            elif finished:
                style = "bold"
            else:
                style = "dim"
            names.append(fit_cell(name, cell), style=style)
            shown = "" if duration is None else duration_text(duration)
            times.append(fit_cell(shown, cell), style="" if style == "bold" else style)
        return Group(names, times)


def duration_text(value_ms: float) -> str:
    """A stage duration in ms, or in seconds from 10 s on."""
    return f"{value_ms / 1000:.2f}s" if value_ms >= 10_000 else f"{value_ms:.1f}ms"


def fit_cell(text: str, width: int) -> str:
    """`text` in a cell `width` wide: one leading space, cut with an ellipsis when too long."""
    text = text if len(text) < width else text[: width - 2] + "…"
    return (" " + text).ljust(width)
