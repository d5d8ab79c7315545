"""Which step's inside the attention and lens panels show, and what the live run captures for them.

Live and held: the waiting step's full views, computed on demand by the session (the step run
again over its cache, the lens over the whole vocabulary). Replay: the recorded step at the
cursor. Otherwise: the last committed token that carries an inspection. Capture follows the
panels on screen: none shown, none asked, and decode keeps its lean path.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.events import Event, TokenEvent
from minengine.inspect.ask import FULL_VIEW, NOTHING, InspectAsk
from minengine.inspect.records import StepInspection
from reqscope.ui.run.replay import ReplayRun
from reqscope.ui.run.view import RunView

ATTENTION_TOP = 8  # positions kept per head while the attention panel shows a running decode
LENS_CANDIDATES = 20  # the tokens the running lens projects onto (the step's most likely ones)
INSPECT_VIEWS = ("attention", "lens")  # the panels that show a step's inside


@dataclass(frozen=True)
class ShownInspection:
    """A step's inside as the panels show it, and how to label it."""

    inspection: StepInspection
    label: str  # e.g. "step 5 waiting · full view", "token 12 committed", "step 5 · recorded"
    token_index: int  # the output token (0-based) the step produced or is about to produce

    @property
    def cost_text(self) -> str:
        """What capturing it cost, from its measured cost: "inspecting: +0.4 ms/step", or "+N ms for
        this view" for a held step's full view (the step run again, once)."""
        cost = self.inspection.cost.cost_ms
        if self.inspection.on_demand:
            return f"inspecting: +{cost:.1f} ms for this view"
        return f"inspecting: +{cost:.1f} ms/step"


def capture_ask(attention: bool, lens: bool) -> InspectAsk:
    """What a running decode captures while the attention and/or lens panel is on screen."""
    if not (attention or lens):
        return NOTHING
    return InspectAsk(attention_top=ATTENTION_TOP if attention else 0, strip=attention,
                      lens="candidates" if lens else None, lens_candidates=LENS_CANDIDATES)


def held_ask(attention: bool, lens: bool) -> InspectAsk | None:
    """What a held step's full view computes for the inside panels on screen (None: none is)."""
    if not (attention or lens):
        return None
    return InspectAsk(attention_top=FULL_VIEW.attention_top if attention else 0, strip=attention,
                      lens=FULL_VIEW.lens if lens else None)


def held_inspection(inspection: StepInspection | None, held: int) -> ShownInspection | None:
    """The held step's views as the session computed them on demand."""
    if inspection is None:
        return None
    return ShownInspection(inspection, f"step {held + 1} waiting · full view", held)


def replay_inspection(replay: ReplayRun, view: RunView) -> ShownInspection | None:
    """The recorded step at the cursor, else the last recorded one before it (`view`: the fold up to the cursor)."""
    pending = replay.pending_token()
    if pending is not None and pending.inspection is not None:
        return ShownInspection(pending.inspection, f"step {pending.index + 1} · recorded", pending.index)
    return last_inspection(view)


def last_inspection(view: RunView) -> ShownInspection | None:
    """The last committed token's inspection, if one was captured (kept by the fold: no scan per repaint)."""
    token = view.last_inspected
    if token is None or token.inspection is None:
        return None
    return ShownInspection(token.inspection, f"token {token.index + 1} committed", token.index)


def recorded_views(events: list[Event]) -> tuple[str, ...]:
    """The inside views a trace's events hold: "attention", "lens", both or neither."""
    inspections = [e.inspection for e in events if isinstance(e, TokenEvent) and e.inspection is not None]
    return tuple(name for name, held in (("attention", any(i.attention for i in inspections)),
                                         ("lens", any(i.lens for i in inspections))) if held)
