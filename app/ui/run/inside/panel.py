"""The base of the panels that show one part of a step's inside (its attention, its logit lens).

Both draw the part of the shown step's inspection they are about; a step that lacks it (a live
run captures it only while the panel is on screen, a trace keeps it for some steps) gets a note
saying when it will show.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from rich.console import RenderableType
from rich.text import Text

from minengine.inspect.records import StepInspection
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.inside.shown import ShownInspection

PartT = TypeVar("PartT")


class InsidePanel(Panel[Frame], Generic[PartT]):
    """Draws one part of the shown step's inspection (`part`, `draw_part`), else why it has none yet."""

    RECORD = ""  # the part's name in a replay's note: "this step has no <RECORD> record"
    LIVE_NOTE = ""  # a live run's note: when the part starts to show

    def part(self, inspection: StepInspection) -> PartT | None:
        """The part of `inspection` this panel draws; None where the step did not capture it."""
        raise NotImplementedError

    def draw_part(self, frame: Frame, shown: ShownInspection, part: PartT, width: int, height: int) -> RenderableType:
        """The panel's content for the shown step's part in a `width` x `height` area."""
        raise NotImplementedError

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        shown = frame.inspection
        part = self.part(shown.inspection) if shown is not None else None
        if shown is None or part is None:
            return Text(self._waiting(frame), style="dim")
        return self.draw_part(frame, shown, part, width, height)

    def _waiting(self, frame: Frame) -> str:
        if frame.replay:
            return f"this step has no {self.RECORD} record: the trace kept it for other steps"
        return self.LIVE_NOTE
