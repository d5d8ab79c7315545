"""The base of every explorer panel: a bordered widget that draws itself from the latest frame."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from reqscope.ui.frame import Frame


class Panel(Widget):
    """Holds the latest Frame and renders it at whatever size the layout gives."""

    TITLE = ""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.frame: Frame | None = None
        self.border_title = self.TITLE

    def show(self, frame: Frame) -> None:
        """Draw `frame` on the next paint (a hidden panel costs nothing until shown)."""
        self.frame = frame
        self.refresh()

    def render(self) -> RenderableType:
        if self.frame is None:
            return Text("waiting for the engine…", style="dim")
        size = self.content_size
        return self.draw(self.frame, max(size.width, 1), max(size.height, 1))

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        """The panel's content for `frame` in a `width` x `height` area."""
        raise NotImplementedError
