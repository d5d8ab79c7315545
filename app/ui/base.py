"""What the two explorers share: the window, the panel layout, repaints, help and the prompt form.

The run explorer (`reqscope.ui.run.app`, live or replayed) and the endpoint explorer
(`reqscope.ui.endpoint.app`) show one request in the same frame: a status line, the pipeline
strip, the readout line (an explorer that has one: the running figures, at every size), an error
box, and a body of panels laid out by `detail_layout` (every panel from 150x40 on, else the
token panel and one detail panel picked with v or the number keys). Both take their run's events
from an inbox on another thread's behalf and draw every panel from one frame per repaint,
through the same `RepaintScheduler`. `ExplorerBase` holds that frame and its machinery; each
explorer fills in its own panels, its frame, its run and what its keys do to it.

Textual calls a message handler (`on_mount`, `on_resize`, `on_unmount`, ...) once for every class
in the MRO that defines it, so those live here only and the explorers plug into them through
the hooks below (`_begin`, `_stop`, ...), never by overriding the handlers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual import events
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Container
from textual.geometry import Size
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from minengine.engine.request import GenerationRequest
from minengine.text.chat_template import Message as ChatMessage
from reqscope.ui.detail_layout import fit_panels, mark_detail_panels, next_view
from reqscope.ui.help_screen import HelpScreen
from reqscope.ui.keys import KEYS, action_name, keys_for
from reqscope.ui.panel import Panel
from reqscope.ui.prompt_form import PromptChoice, PromptForm
from reqscope.ui.repaint_pacer import RepaintPacer
from reqscope.ui.repaint_scheduler import RepaintScheduler

# The share of one core that repainting may take while the run streams. On 2 cores whose both
# threads decode, at 0.08 the explorer decoded at 0.88-0.90 of headless speed, at 0.04 (4-6
# frames a second at 160x50, ~8 ms each) at 0.96. A spare core does not buy more: decoding on
# one thread beside a free core, 0.04 kept 0.97, 0.10 0.92 and 0.25 0.77, because drawing holds
# the GIL that the engine thread needs back between its ~120 kernels a step.
REPAINT_DUTY = 0.04
SLOWEST_REPAINT_S = 2.0  # however costly, the screen follows a streaming run at least every 2 s
_KEYED_ACTIONS = frozenset(action_name(k) for k in KEYS)


class RunProgress(Message):
    """The run's thread has news for the UI (events, a held step, its end); posted from that thread."""

    def __init__(self, urgent: bool) -> None:
        super().__init__()
        self.urgent = urgent  # a held step or the end of the run: take it now


def renewed(request: GenerationRequest, **changes: object) -> GenerationRequest:
    """A copy of `request` with `changes` and a new request id (a new run is a new request)."""
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request) if f.name != "request_id"}
    return GenerationRequest(**(fields | changes))


class ExplorerBase(App[int]):
    """The frame both explorers draw in; a subclass supplies its panels, its run and its frame.

    A subclass names its panels (`PIPELINE`, `BODY`, `DETAIL_VIEWS`) and implements the hooks:
    `_begin` (start the run once the screen is up), `_take_events` and `_streaming` (for the
    repaint scheduler), `_frame`, `_status_line` and `_error_line` (what one repaint draws),
    `_rerun` (send the request again with changes) and `_stop` (end the run when leaving).
    """

    # Absolute, so that the explorers in the subfolders find it: Textual resolves a relative
    # CSS_PATH against the file of the class being run, not of the class that set it.
    CSS_PATH = Path(__file__).parent / "explorer.tcss"
    TITLE = "reqscope"
    PIPELINE: ClassVar[type[Panel]]  # the strip under the status line (id "pipeline")
    READOUT: ClassVar[type[Panel] | None] = None  # one line of running figures under it (id "readout"), if any
    BODY: ClassVar[tuple[tuple[str, type[Panel]], ...]] = ()  # (id, panel) in grid order, "tokens" first
    DETAIL_VIEWS: ClassVar[tuple[str, ...]] = ()  # the panel ids that take turns on small terminals
    # Detail panels that join them only while they apply (`_detail_views` says when)
    OPTIONAL_VIEWS: ClassVar[tuple[str, ...]] = ()
    VIEW_LABELS: ClassVar[Mapping[str, str]] = {}  # a detail panel's name in the hints, where not its id

    KEYS_SKIP_PACER: ClassVar[bool] = False  # whether a key's repaint is drawn at once while the run streams

    def __init__(self, *, mode: str, repaint_hz: float) -> None:
        super().__init__()
        self.mode = mode  # which keys apply: "live", "replay" or "endpoint" (see keys.py)
        self._mode_actions = frozenset(action_name(k) for k in keys_for(mode, self.OPTIONAL_VIEWS))
        self.request: GenerationRequest | None = None  # the request on screen (a replay has none)
        self.compact_view = self.DETAIL_VIEWS[0]
        self.load_error: str | None = None  # why the run could not start (no engine, no server)
        self.repaints = 0
        pacer = RepaintPacer(max_hz=repaint_hz, duty=REPAINT_DUTY, slowest_s=SLOWEST_REPAINT_S)
        self.repaint = RepaintScheduler(self, pacer, take=self._take_events, draw=self._redraw,
                                        streaming=self._streaming)

    # -- layout --------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield self.PIPELINE(id="pipeline")
        if self.READOUT is not None:
            yield self.READOUT(id="readout")
        yield Static(id="error")
        with Container(id="body"):
            for panel_id, panel in self.BODY:
                yield panel(id=panel_id)
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        mark_detail_panels(self, self.DETAIL_VIEWS + self.OPTIONAL_VIEWS)
        self._fit_layout()
        self._begin()

    def on_resize(self, event: events.Resize) -> None:
        self._fit_layout(event.size)

    def on_unmount(self) -> None:
        self._stop()

    def _fit_layout(self, size: Size | None = None) -> None:
        views = self._detail_views()
        if self.compact_view not in views:  # an optional panel that no longer applies
            self.compact_view = views[0]
        fit_panels(self, size or self.size, views, self.compact_view, self.VIEW_LABELS,
                   {name: self.view_key(name) for name in views})
        self._invalidate()

    def view_key(self, name: str) -> str:
        """The key that shows the detail panel `name` in this explorer's mode."""
        action = f"view({name!r})"
        return next((k.keys for k in keys_for(self.mode, self.OPTIONAL_VIEWS) if k.action == action), "?")

    def _optional_shown(self) -> tuple[str, ...]:
        """The optional detail panels that apply now."""
        return tuple(name for name in self._detail_views() if name in self.OPTIONAL_VIEWS)

    def _detail_views(self) -> tuple[str, ...]:
        """The detail panels that take turns on small terminals now: DETAIL_VIEWS, and the optional ones that apply."""
        return self.DETAIL_VIEWS

    @property
    def wide(self) -> bool:
        """True when every panel is on screen at once."""
        return self.query_one("#body").has_class("-wide")

    @property
    def needs_repaint(self) -> bool:
        """True while a change waits for the next repaint."""
        return self.repaint.dirty

    # -- events in, repaints out ---------------------------------------------------------------

    def _wake(self, urgent: bool) -> None:
        """Tell the UI the run has news; called from the run's thread."""
        self.post_message(RunProgress(urgent))  # thread-safe: Textual queues it for this thread

    def on_run_progress(self, message: RunProgress) -> None:
        # With a repaint already scheduled, events can wait for it: the repaint takes them all
        # at once, and the run's thread stays quiet until then.
        if message.urgent or not self.repaint.paced:
            self._take_events()

    def _invalidate(self, now: bool = False) -> None:
        """Ask for a repaint once the current handler is done (many asks, one repaint).

        While the run streams, repaints are paced; `now` skips the pacer (a key's repaint).
        """
        self.repaint.invalidate(now)

    def _redraw(self) -> None:
        """Draw the status line, the error box and every panel from one frame."""
        if not self._ready_to_draw() or not self.query("#status"):
            return  # nothing to draw yet, or a paced repaint firing while the app shuts down
        self.repaints += 1
        self.repaint.pacer.repainting()
        frame = self._frame()
        self.query_one("#status", Static).update(self._status_line(frame))
        error = self._error_line()
        box = self.query_one("#error", Static)
        box.update(Text(f"error: {error}", style="bold") if error else "")
        box.set_class(bool(error), "-shown")
        for panel in self.query(Panel):
            panel.show(frame)

    # -- actions both explorers have -----------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The actions here serve several modes; one whose keys belong to other modes only never runs.
        return action not in _KEYED_ACTIONS or action in self._mode_actions

    def action_restart(self) -> None:
        """Run the same messages again with the current settings."""
        self._rerun()

    def action_edit_prompt(self, field: str = "prompt") -> None:
        """Edit the prompt and the system prompt, then run them."""
        if not self._can_edit_prompt():
            return
        assert self.request is not None
        system = next((m.content for m in self.request.messages if m.role == "system"), "")
        prompt = next((m.content for m in reversed(self.request.messages) if m.role == "user"), "")
        self.push_screen(PromptForm(PromptChoice(system, prompt), focus=field), self._prompt_chosen)

    def action_edit_system(self) -> None:
        """Edit the system prompt (the same form, starting in its field)."""
        self.action_edit_prompt("system")

    def _prompt_chosen(self, choice: PromptChoice | None) -> None:
        if choice is None:
            return
        messages = ((ChatMessage("system", choice.system),) if choice.system.strip() else ()) + (
            ChatMessage("user", choice.prompt),
        )
        self._rerun(messages=messages)

    def action_next_view(self) -> None:
        """Cycle the detail panel shown on small terminals."""
        self.action_view(next_view(self._detail_views(), self.compact_view))

    def action_view(self, name: str) -> None:
        """Show one detail panel on small terminals."""
        self.compact_view = name
        self._fit_layout()
        self._invalidate(now=self.KEYS_SKIP_PACER)

    def action_help(self) -> None:
        """The help screen."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.mode, self._optional_shown()))

    async def action_quit(self) -> None:
        """Stop the request on screen (cancel the run, close the stream), then leave."""
        self._stop()
        self.exit(0)

    # -- the command palette -------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for key in keys_for(self.mode, self._optional_shown()):
            if key.action.startswith(("cursor", "view(")):
                continue
            yield SystemCommand(key.label, f"{key.help} [{key.display}]", partial(self.run_action, key.action))

    # -- hooks ---------------------------------------------------------------------------------

    def _begin(self) -> None:
        """Start the run: the panels are mounted and laid out."""
        raise NotImplementedError

    def _take_events(self) -> None:
        """Fold the events waiting in the run's inbox into the view; ask for a repaint if any."""
        raise NotImplementedError

    def _streaming(self) -> bool:
        """True while events keep arriving (the pacer applies)."""
        raise NotImplementedError

    def _ready_to_draw(self) -> bool:
        """False while there is nothing to draw a frame from yet."""
        return True

    def _frame(self) -> object:
        """What one repaint draws every panel from."""
        raise NotImplementedError

    def _status_line(self, frame: object) -> RenderableType:
        """The status line for `frame`."""
        raise NotImplementedError

    def _error_line(self) -> str | None:
        """The error to show above the panels, if any."""
        raise NotImplementedError

    def _can_edit_prompt(self) -> bool:
        """Whether the prompt form may open now; when not, this tells the user why."""
        return True

    def _rerun(self, **changes: object) -> None:
        """Run the request on screen again with `changes`; when it cannot, tell the user why."""
        raise NotImplementedError

    def _stop(self) -> None:
        """End the run on screen: the explorer is leaving."""
        raise NotImplementedError
