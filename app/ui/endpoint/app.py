"""The explorer as a client of an OpenAI-compatible server (`reqscope --base-url URL`).

Only what crosses the wire can be shown: the client's timeline (connection, first byte, first
token, every chunk), its TTFT/ITL/TPOT/E2E, the text chunk by chunk, the top logprobs when asked
for (off by default: they can slow the server, and when on, the cost is shown) and, from
`reqscope serve` or llama.cpp's server, the server's own times beside the client's. The request
carries only the settings the user gave (`RequestSettings`); the rest are the server's defaults.
What needs the engine's inside (per-layer KV, the logits, the sampler's cuts, pausing
between tokens) is not observable here; the panels say so, and the KV panel shows the planner's
computed figures when `--card` names the model's shape.

The client runs on its own thread (see `endpoint_worker`); events reach this thread through the
request's inbox and one `RunProgress` message per burst, and repaints are paced as in the
engine explorer (both are `ExplorerBase`s).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import RenderableType
from textual import work

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.plan.cards import Architecture
from reqscope.endpoint.controls import OutputControls
from reqscope.endpoint.events import ClientEvent, RequestSent, StreamEnded
from reqscope.endpoint.server.poller import pollable
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.endpoint.trace import EndpointTraceHeader, write_endpoint_trace
from reqscope.ui.base import ExplorerBase, renewed
from reqscope.ui.endpoint.batch_panel import EndpointBatchPanel
from reqscope.ui.endpoint.frame import Baseline, EndpointFrame
from reqscope.ui.endpoint.kv_panel import EndpointKVPanel
from reqscope.ui.endpoint.latency_panel import EndpointLatencyPanel
from reqscope.ui.endpoint.logprobs_panel import EndpointLogprobsPanel
from reqscope.ui.endpoint.prompt_panel import ServerPromptPanel
from reqscope.ui.endpoint.settings_form import EndpointSettingsForm
from reqscope.ui.endpoint.status_line import endpoint_status
from reqscope.ui.endpoint.stream_panel import AnswerPanel, EndpointPipelinePanel
from reqscope.ui.endpoint.timeline_panel import EndpointTimelinePanel
from reqscope.ui.endpoint.view import EndpointView
from reqscope.ui.endpoint.worker import EndpointRequest, EndpointWorker
from reqscope.ui.keys import ENDPOINT, bindings
from reqscope.ui.run.export_folder import DEFAULT_ROOT, claim_run_folder
from reqscope.wording import error_text


class EndpointApp(ExplorerBase):
    """The endpoint explorer: one request at a time against one server."""

    BINDINGS = bindings(ENDPOINT)
    PIPELINE = EndpointPipelinePanel
    BODY = (("tokens", AnswerPanel), ("logits", EndpointLogprobsPanel), ("kv", EndpointKVPanel),
            ("latency", EndpointLatencyPanel), ("timeline", EndpointTimelinePanel),
            ("template", ServerPromptPanel), ("batch", EndpointBatchPanel))
    DETAIL_VIEWS = ("logits", "kv", "latency", "timeline", "template", "batch")
    VIEW_LABELS = {"logits": "logprobs"}  # the panel ids match the engine explorer's; the logits here are logprobs
    KEYS_SKIP_PACER = True  # the cursor and the panel keys show their change at once, even mid-stream

    def __init__(
        self,
        target: EndpointTarget,
        request: GenerationRequest,
        *,
        settings: RequestSettings | None = None,
        arch: Architecture | None = None,
        repaint_hz: float = 20.0,
        replay: list[ClientEvent] | None = None,
        export_root: Path = DEFAULT_ROOT,
        controls: OutputControls | None = None,
    ) -> None:
        """`replay`: the recorded events of one request (`reqscope replay`), drawn instead of sending it.
        `controls`: the tools, output shape, penalties and bias every send carries (None: the request's own)."""
        super().__init__(mode=ENDPOINT, repaint_hz=repaint_hz)
        self.target = target
        self.request = request  # the request on screen: its messages
        self.settings = settings or RequestSettings()  # its sampling and logprobs, as sent (None: server default)
        self.next_settings: RequestSettings | None = None  # settings changed since, for the next send
        self.controls = controls
        self.arch = arch
        self.worker: EndpointWorker | None = None
        self.model = ""
        self.run_: EndpointRequest | None = None
        self.view = EndpointView()
        self.history: list[EndpointView] = []  # earlier requests of this session, newest last
        self.cursor: int | None = None
        self.replay = replay
        self.export_root = export_root
        self.last_export: Path | None = None

    # -- the client ----------------------------------------------------------------------------

    def _begin(self) -> None:
        self.query_one("#body").add_class("-server")  # the server's template and batch panels (explorer.tcss)
        if self.replay is None:
            self._connect()
            return
        for event in self.replay:
            self.view.apply(event)
        sent = self.view.sent
        self.model = sent.model if sent is not None else ""
        server = self.view.server
        self.query_one("#body").set_class(server is not None and pollable(server.kind), "-server-strip")
        self._invalidate()

    @classmethod
    def replaying(cls, header: EndpointTraceHeader, events: list[ClientEvent]) -> EndpointApp:
        """The explorer on a recorded request: its panels as they were when the request ended."""
        sent = next((e for e in events if isinstance(e, RequestSent)), None)
        request = GenerationRequest(messages=sent.messages if sent is not None else ())
        server = next((e.result.server_view for e in events if isinstance(e, StreamEnded)), None)
        poll_ms = server.poll_interval_ms if server is not None else 0.0
        target = EndpointTarget(header.url, model=header.model, poll_ms=poll_ms)
        return cls(target, request, settings=sent.settings if sent is not None else None, replay=events)

    @work(thread=True, group="connect", exit_on_error=False)
    def _connect(self) -> None:
        worker = self.worker or EndpointWorker(self.target)
        self.worker = worker
        try:
            model = worker.connect()
        except ReqscopeError as exc:
            self.call_from_thread(self._connect_failed, error_text(exc))
            return
        self.call_from_thread(self._connected, model)

    def _connect_failed(self, message: str) -> None:
        self.load_error = message
        self.notify(message, title="cannot use the endpoint", severity="error", timeout=30)
        self._invalidate()

    def _connected(self, model: str) -> None:
        self.model = model
        # The strip of the server's template and batch, where the server offers them (explorer.tcss).
        kind = self.worker.kind if self.worker is not None else None
        self.query_one("#body").set_class(kind is not None and pollable(kind), "-server-strip")
        self.load_error = None
        self._start(self.request, self.settings)

    def _start(self, request: GenerationRequest, settings: RequestSettings) -> None:
        """Send `request` with `settings`, closing the stream on screen first if it still runs."""
        assert self.worker is not None
        if self.run_ is not None:
            self.run_.cancel()
            self.history.append(self.view)
        self.request = request
        self.settings = settings
        self.next_settings = None
        self.view = EndpointView()
        self.cursor = None
        self.run_ = EndpointRequest(request, wake=self._wake, settings=settings, controls=self.controls)
        self.worker.start(self.run_)
        self._invalidate()

    def _rerun(self, **changes: object) -> None:
        if self._can_send():
            self._start(renewed(self.request, **changes), self.next_settings or self.settings)

    def _take_events(self) -> None:
        # Taking empties the inbox, so the run's next event wakes this thread again.
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

    def _streaming(self) -> bool:
        return self.run_ is not None and not self.view.done

    def _frame(self) -> EndpointFrame:
        return EndpointFrame(
            view=self.view,
            url=self.target.url,
            model=self.model,
            request=self.request,
            state=self.state,
            cursor=self.cursor,
            arch=self.arch,
            new_connection=self.target.new_connection,
            settings=self.settings,
            next_settings=self.next_settings,
            baseline=self._baseline() if self.settings.logprobs else None,
            poll_ms=self.target.poll_ms,
            otlp_listen=self.target.otlp_listen is not None and self.replay is None,
        )

    def _baseline(self) -> Baseline | None:
        """The newest earlier request sent without logprobs that has a TPOT: the cost of asking is measured on it."""
        for number, view in reversed(list(enumerate(self.history, start=1))):
            result = view.result
            if view.sent is None or view.sent.settings.logprobs or result is None or result.error:
                continue
            if result.metrics is not None and result.metrics.tpot_ms is not None:
                return Baseline(number, result.metrics.tpot_ms)
        return None

    def _status_line(self, frame: EndpointFrame) -> RenderableType:
        return endpoint_status(frame, len(self.history) + 1)

    def _error_line(self) -> str | None:
        return self.load_error or self.view.error or (self.run_.failure if self.run_ else None)

    @property
    def state(self) -> str:
        """Where the request on screen stands, in one word or two."""
        view = self.view
        if self.replay is not None and view.result is not None:
            return "error" if view.result.error else (view.result.finish_reason or "done")
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

    def action_sampling(self) -> None:
        """The settings form: sampling and logprobs for the next request (the server samples, not reqscope)."""
        self.push_screen(EndpointSettingsForm(self.next_settings or self.settings), self._settings_chosen)

    def _settings_chosen(self, settings: RequestSettings | None) -> None:
        if settings is None:
            return
        self.next_settings = settings
        self.notify("the new settings go with the next request: r sends it")
        self._invalidate()

    def _stop(self) -> None:
        if self.run_ is not None and not self.view.done:
            self.run_.cancel()
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def action_export(self) -> None:
        """Write the finished request's events into a new folder under the export root (`reqscope replay` reads it)."""
        view = self.view
        if not view.done:
            self.notify("the request is still streaming: export when it ends (c cancels it)")
            return
        sent = view.sent
        name = (sent.display_id or sent.request_id) if sent is not None and sent.request_id else "endpoint-request"
        try:
            folder = claim_run_folder(self.export_root, name)
            path = write_endpoint_trace(folder, EndpointTraceHeader(self.target.url, self.model), view.events)
        except OSError as exc:
            self.notify(f"cannot write to {self.export_root}: {exc.strerror or exc}", title="export failed",
                        severity="error", timeout=15)
            return
        self.last_export = path
        self.notify(f"{path}: reqscope replay {path}", title="exported", timeout=15)

    def _can_send(self) -> bool:
        if self.replay is not None:
            self.notify("a replay: nothing to send (reqscope --base-url URL sends the request)")
            return False
        if self.worker is None or not self.model:
            self.notify("not connected" + (f": {self.load_error}" if self.load_error else ""))
            return False
        return True
