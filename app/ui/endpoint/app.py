"""The explorer as a client of an OpenAI-compatible server (`reqscope --endpoint URL`).

Only what crosses the wire can be shown: the client's timeline (connection, first byte, first
token, every chunk), its TTFT/ITL/TPOT/E2E, the text chunk by chunk, the top logprobs when the
server returns them and, from `reqscope serve`, the server's own stage times beside the
client's. What needs the engine's inside (per-layer KV, the logits, the sampler's cuts, pausing
between tokens) is not observable here; the panels say so, and the KV panel shows the planner's
computed figures when `--config` names the model's shape.

The client runs on its own thread (see `endpoint_worker`); events reach this thread through the
request's inbox and one `EndpointProgress` message per burst, and repaints are paced as in the
engine explorer.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path

from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Container
from textual.geometry import Size
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.plan.cards import Architecture
from minengine.text.chat_template import Message as ChatMessage
from reqscope.endpoint.events import StreamEnded
from reqscope.ui.detail_layout import fit_panels, mark_detail_panels, next_view
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.endpoint.kv_panel import EndpointKVPanel
from reqscope.ui.endpoint.latency_panel import EndpointLatencyPanel
from reqscope.ui.endpoint.logprobs_panel import EndpointLogprobsPanel
from reqscope.ui.endpoint.status_line import endpoint_status
from reqscope.ui.endpoint.stream_panel import AnswerPanel, EndpointPipelinePanel
from reqscope.ui.endpoint.timeline_panel import EndpointTimelinePanel
from reqscope.ui.endpoint.view import EndpointView
from reqscope.ui.endpoint.worker import EndpointRequest, EndpointTarget, EndpointWorker
from reqscope.ui.help_screen import HelpScreen
from reqscope.ui.keys import ENDPOINT, bindings, keys_for
from reqscope.ui.panel import Panel
from reqscope.ui.prompt_form import PromptChoice, PromptForm
from reqscope.ui.repaint_pacer import RepaintPacer
from reqscope.ui.repaint_scheduler import RepaintScheduler
from reqscope.ui.run.app import renewed
from reqscope.ui.sampling_form import SamplingChoice, SamplingForm

DETAIL_VIEWS: tuple[str, ...] = ("logits", "kv", "latency", "timeline")
_VIEW_LABELS = {"logits": "logprobs"}  # the panel ids match the engine explorer's; the logits here are logprobs


class EndpointProgress(Message):
    """The client has news for the UI (chunks, the end of the stream); posted from its thread."""

    def __init__(self, urgent: bool) -> None:
        super().__init__()
        self.urgent = urgent


class EndpointApp(App[int]):
    """The endpoint explorer: one request at a time against one server."""

    CSS_PATH = Path(__file__).parent.parent / "explorer.tcss"
    TITLE = "reqscope"
    BINDINGS = bindings(ENDPOINT)

    def __init__(
        self,
        target: EndpointTarget,
        request: GenerationRequest,
        *,
        arch: Architecture | None = None,
        repaint_hz: float = 20.0,
    ) -> None:
        super().__init__()
        self.target = target
        self.request = request  # the request on screen
        self.next_request: GenerationRequest | None = None  # settings changed since, for the next send
        self.arch = arch
        self.worker: EndpointWorker | None = None
        self.model = ""
        self.run_: EndpointRequest | None = None
        self.view = EndpointView()
        self.history: list[EndpointView] = []  # earlier requests of this session, newest last
        self.cursor: int | None = None
        self.compact_view = DETAIL_VIEWS[0]
        self.load_error: str | None = None
        self.repaints = 0
        self.repaint = RepaintScheduler(self, RepaintPacer(max_hz=repaint_hz), take=self._take, draw=self._redraw,
                                        streaming=self._streaming)

    # -- layout --------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield EndpointPipelinePanel(id="pipeline")
        yield Static(id="error")
        with Container(id="body"):
            yield AnswerPanel(id="tokens")
            yield EndpointLogprobsPanel(id="logits")
            yield EndpointKVPanel(id="kv")
            yield EndpointLatencyPanel(id="latency")
            yield EndpointTimelinePanel(id="timeline")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        mark_detail_panels(self, DETAIL_VIEWS)
        self._fit_layout()
        self._connect()

    def on_resize(self, event: events.Resize) -> None:
        self._fit_layout(event.size)

    def _fit_layout(self, size: Size | None = None) -> None:
        fit_panels(self, size or self.size, DETAIL_VIEWS, self.compact_view, _VIEW_LABELS)
        self._invalidate()

    @property
    def wide(self) -> bool:
        """True when every panel is on screen at once."""
        return self.query_one("#body").has_class("-wide")

    @property
    def needs_repaint(self) -> bool:
        """True while a change waits for the next repaint."""
        return self.repaint.dirty

    # -- the client ----------------------------------------------------------------------------

    @work(thread=True, group="connect", exit_on_error=False)
    def _connect(self) -> None:
        worker = self.worker or EndpointWorker(self.target)
        self.worker = worker
        try:
            model = worker.connect()
        except ReqscopeError as exc:
            self.call_from_thread(self._connect_failed, str(exc))
            return
        self.call_from_thread(self._connected, model)

    def _connect_failed(self, message: str) -> None:
        self.load_error = message
        self.notify(message, title="cannot use the endpoint", severity="error", timeout=30)
        self._invalidate()

    def _connected(self, model: str) -> None:
        self.model = model
        self.load_error = None
        self._start(self.request)

    def _start(self, request: GenerationRequest) -> None:
        """Send `request`, closing the stream on screen first if it still runs."""
        assert self.worker is not None
        if self.run_ is not None:
            self.run_.cancel()
            self.history.append(self.view)
        self.request = request
        self.next_request = None
        self.view = EndpointView()
        self.cursor = None
        self.run_ = EndpointRequest(request, wake=self._wake)
        self.worker.start(self.run_)
        self._invalidate()

    def _wake(self, urgent: bool) -> None:
        self.post_message(EndpointProgress(urgent))  # thread-safe

    def on_endpoint_progress(self, message: EndpointProgress) -> None:
        if message.urgent or not self.repaint.paced:
            self._take()

    def _take(self) -> None:
        """Fold in the events waiting in the run's inbox; the next event wakes this thread again."""
        run = self.run_
        if run is None:
            return
        events = run.take()
        for event in events:
            self.view.apply(event)
        ended = run.finished.is_set() and self.view.result is None and not self.view.cancelled
        if ended:  # closed before the stream's end: cancelled by a key, or the client failed
            self.view.cancelled = run.cancelled
            if run.failure:
                self.notify(run.failure, title="the endpoint client failed", severity="error", timeout=30)
        if any(isinstance(e, StreamEnded) for e in events) and self.view.error:
            self.notify(self.view.error, title="request failed", severity="error", timeout=30)
        if events or ended:
            self._invalidate()

    # -- repaints ------------------------------------------------------------------------------

    def _invalidate(self, now: bool = False) -> None:
        """Ask for a repaint; while the answer streams, repaints are paced, except for a key's (`now`)."""
        self.repaint.invalidate(now)

    def _streaming(self) -> bool:
        return self.run_ is not None and not self.view.done

    def _redraw(self) -> None:
        if not self.query("#status"):
            return  # a paced repaint firing while the app shuts down
        self.repaints += 1
        self.repaint.pacer.repainting()
        frame = EndpointFrame(
            view=self.view,
            url=self.target.url,
            model=self.model,
            request=self.request,
            state=self.state,
            cursor=self.cursor,
            arch=self.arch,
            new_connection=self.target.new_connection,
            next_request=self.next_request,
        )
        self.query_one("#status", Static).update(endpoint_status(frame, len(self.history) + 1))
        error = self.load_error or self.view.error or (self.run_.failure if self.run_ else None)
        box = self.query_one("#error", Static)
        box.update(Text(f"error: {error}", style="bold") if error else "")
        box.set_class(bool(error), "-shown")
        for panel in self.query(Panel):
            panel.show(frame)

    @property
    def state(self) -> str:
        """Where the request on screen stands, in one word or two."""
        view = self.view
        if self.load_error is not None or (self.run_ is not None and self.run_.failure):
            return "error"
        if self.run_ is None:
            return "connecting"
        if view.result is not None:
            return "error" if view.result.error else (view.result.finish_reason or "done")
        if view.cancelled:
            return "cancelled"
        if view.response is None:
            return "connecting"
        return "streaming" if view.chunks else "waiting"

    # -- actions -------------------------------------------------------------------------------

    def action_cursor(self, delta: int) -> None:
        """Move the chunk the logprobs panel explains; back at the last one, follow the newest again."""
        count = len(self.view.chunks)
        if not count:
            return
        at = (count - 1 if self.cursor is None else self.cursor) + delta
        self.cursor = None if at >= count - 1 else max(at, 0)
        self._invalidate(now=True)

    def action_cancel(self) -> None:
        """Close the stream of the request on screen."""
        if self.run_ is None or self.view.done:
            self.notify("no request is streaming: r sends it again")
            return
        self.run_.cancel()
        self.notify("cancelled: the connection is closed, so the server can stop decoding")

    def action_restart(self) -> None:
        """Send the same messages again with the current settings."""
        if self._can_send():
            self._start(renewed(self.next_request or self.request))

    def action_sampling(self) -> None:
        """The sampling form; the settings go with the next request (the server samples, not reqscope)."""
        upcoming = self.next_request or self.request
        current = SamplingChoice(upcoming.sampling, upcoming.max_tokens)
        self.push_screen(SamplingForm(current, lambda params: None, omit=frozenset({"order"})), self._sampling_chosen)

    def _sampling_chosen(self, choice: SamplingChoice | None) -> None:
        if choice is None:
            return
        self.next_request = renewed(self.request, sampling=choice.params, max_tokens=choice.max_tokens)
        self.notify("the new settings go with the next request: r sends it")
        self._invalidate()

    def action_edit_prompt(self, field: str = "prompt") -> None:
        """Edit the prompt and the system prompt, then send them."""
        system = next((m.content for m in self.request.messages if m.role == "system"), "")
        prompt = next((m.content for m in reversed(self.request.messages) if m.role == "user"), "")
        self.push_screen(PromptForm(PromptChoice(system, prompt), focus=field), self._prompt_chosen)

    def action_edit_system(self) -> None:
        """Edit the system prompt (the same form, starting in its field)."""
        self.action_edit_prompt("system")

    def _prompt_chosen(self, choice: PromptChoice | None) -> None:
        if choice is None or not self._can_send():
            return
        messages = ((ChatMessage("system", choice.system),) if choice.system.strip() else ()) + (
            ChatMessage("user", choice.prompt),
        )
        self._start(renewed(self.next_request or self.request, messages=messages))

    def action_next_view(self) -> None:
        """Cycle the detail panel shown on small terminals."""
        self.action_view(next_view(DETAIL_VIEWS, self.compact_view))

    def action_view(self, name: str) -> None:
        """Show one detail panel on small terminals."""
        self.compact_view = name
        self._fit_layout()
        self._invalidate(now=True)

    def action_help(self) -> None:
        """The help screen."""
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(ENDPOINT))

    async def action_quit(self) -> None:
        """Close a running stream, then leave."""
        self._stop()
        self.exit(0)

    def on_unmount(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.run_ is not None and not self.view.done:
            self.run_.cancel()
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def _can_send(self) -> bool:
        if self.worker is None or not self.model:
            self.notify("not connected" + (f": {self.load_error}" if self.load_error else ""))
            return False
        return True

    # -- the command palette -------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for key in keys_for(ENDPOINT):
            if key.action.startswith(("cursor", "view(")):
                continue
            yield SystemCommand(key.label, f"{key.help} [{key.display}]", partial(self.run_action, key.action))
