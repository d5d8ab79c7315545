"""The base of every explorer panel: a bordered widget that draws itself from the latest frame.

A frame is whatever one repaint gathers: the engine explorer's `Frame`, or the endpoint
explorer's `EndpointFrame`; panels are typed by the frame they draw.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

FrameT = TypeVar("FrameT")


class Panel(Widget, Generic[FrameT]):
    """Holds the latest frame and renders it at whatever size the layout gives."""

    TITLE = ""
    WAITING = "waiting for the engine…"  # drawn before the first frame

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.frame: FrameT | None = None
        self.border_title = self.TITLE

    def show(self, frame: FrameT) -> None:
        """Draw `frame` on the next paint (a hidden panel costs nothing until shown)."""
        self.frame = frame
        self.refresh()

    def render(self) -> RenderableType:
        if self.frame is None:
            return Text(self.WAITING, style="dim")
        size = self.content_size
        return self.draw(self.frame, max(size.width, 1), max(size.height, 1))

    def draw(self, frame: FrameT, width: int, height: int) -> RenderableType:
        """The panel's content for `frame` in a `width` x `height` area."""
        raise NotImplementedError
