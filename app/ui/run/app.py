"""The explorer: one request on screen, live from the engine or replayed from a trace.

The engine loads and runs on one thread of its own (`ModelThread`, see `live_run`). It never
calls into the UI per token: events wait in the run's inbox, and one `RunProgress` message
wakes the UI to take all of them. Repaints are coalesced and, while the engine decodes, paced by `RepaintPacer`
(at most `repaint_hz` a second, and no more than `REPAINT_DUTY` of a core, see `ExplorerBase`),
so a slow terminal repaints less often instead of slowing decode. Every panel draws a bounded
amount, so a repaint costs the same at token 10 and token 10,000.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import RenderableType
from textual import work
from textual.app import SystemCommand
from textual.screen import Screen
from textual.timer import Timer

from minengine.device import device_memory_bytes
from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, PrefillEvent, RequestResult
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.progress import PullProgress, StatusCallback
from minengine.record.export import export_run
from minengine.record.trace_io import TraceHeader, trace_header
from minengine.sampling.sampler import SamplingParams
from minengine.threads import ModelThread
from reqscope.ui.base import ExplorerBase, renewed
from reqscope.ui.keys import LIVE, REPLAY, action_name, bindings, keys_for
from reqscope.ui.loading_screen import LoadingScreen
from reqscope.ui.panels.kv import KVPanel
from reqscope.ui.panels.latency import LatencyPanel
from reqscope.ui.panels.layout import LayoutPanel
from reqscope.ui.panels.logits import LogitsPanel
from reqscope.ui.panels.pipeline import PipelinePanel
from reqscope.ui.panels.readout import ReadoutPanel
from reqscope.ui.panels.template import TemplatePanel
from reqscope.ui.panels.tokens import TokensPanel
from reqscope.ui.run.export_folder import DEFAULT_ROOT, claim_run_folder
from reqscope.ui.run.frame import Frame, StepSubject
from reqscope.ui.run.latency import RunTtft, latency_figures
from reqscope.ui.run.layout_compare import MeasuredLayout, measured_layout
from reqscope.ui.run.live import LiveRun
from reqscope.ui.run.memory_probe import MemoryProbe
from reqscope.ui.run.replay import ReplayRun
from reqscope.ui.run.status_line import settings_note, status_text
from reqscope.ui.run.step_subject import held_subject, last_token_subject, replay_subject
from reqscope.ui.run.view import RunView
from reqscope.ui.sampling_form import SamplingChoice, SamplingForm
from reqscope.wording import error_text

if TYPE_CHECKING:  # numpy, only for a fit given with --service-model
    from minengine.plan.service_model import ServiceModel

EngineOpener = Callable[[StatusCallback], Engine]

_LIVE_ONLY = {action_name(k) for k in keys_for(LIVE)} - {action_name(k) for k in keys_for(REPLAY)}
_REPLAY_ONLY = {action_name(k) for k in keys_for(REPLAY)} - {action_name(k) for k in keys_for(LIVE)}
_PLAYBACK_MS = (20.0, 500.0)  # replay plays at the recorded pace, within these bounds per token
GIL_SWITCH_S = 0.0005


class ExplorerApp(ExplorerBase):
    """The explorer. Build it with `ExplorerApp.live_run(...)` or `ExplorerApp.replaying(...)`."""

    BINDINGS = bindings(LIVE, REPLAY)
    PIPELINE = PipelinePanel
    READOUT = ReadoutPanel
    BODY = (("tokens", TokensPanel), ("logits", LogitsPanel), ("kv", KVPanel), ("latency", LatencyPanel),
            ("layouts", LayoutPanel), ("template", TemplatePanel))
    DETAIL_VIEWS = ("logits", "kv", "layouts", "latency", "template")

    def __init__(
        self,
        *,
        open_engine: EngineOpener | None = None,
        request: GenerationRequest | None = None,
        replay: ReplayRun | None = None,
        start_paused: bool = False,
        export_root: Path = DEFAULT_ROOT,
        repaint_hz: float = 30.0,  # the most repaints a second; fewer when drawing is slow
        source_name: str = "",
        service_model: ServiceModel | None = None,  # a `reqscope calibrate` fit: its prefill beside the measured
    ) -> None:
        if (replay is None) == (open_engine is None or request is None):
            raise ValueError("give either open_engine and request (live) or replay")
        super().__init__(mode=REPLAY if replay is not None else LIVE, repaint_hz=repaint_hz)
        self._open_engine = open_engine
        self.request = request
        self.replay = replay
        self.start_paused = start_paused
        self.export_root = export_root
        self.source_name = source_name
        self.engine: Engine | None = None
        self.header: TraceHeader | None = replay.header if replay else None
        self.live: LiveRun | None = None
        self.view = RunView()
        self.params = request.sampling if request else SamplingParams()
        self.max_tokens = request.max_tokens if request else 0
        self.measured: dict[str, MeasuredLayout] = {}
        self.prefill_history: list[tuple[int, float]] = []  # (prompt tokens computed, prefill ms) per run
        self.ttft_history: list[RunTtft] = []  # every finished run's TTFT and prefix cache reuse
        self.service_model = service_model
        self.cursor = 0
        self.last_export: Path | None = None
        self._previewing: SamplingParams | None = None  # typed in the form, not yet applied
        self._applied: SamplingParams | None = None  # what the session was last told to use
        self._held: int | None = None
        self._preview_cache: tuple[tuple, StepSubject | None] | None = None
        self._probe: MemoryProbe | None = None
        self._play_timer: Timer | None = None
        self._switch_interval = sys.getswitchinterval()
        self._model_thread = ModelThread()  # loading and every run: one OpenMP team (see ModelThread)
        self._loading: LoadingScreen | None = None
        self._reported_failure = False

    @classmethod
    def live_run(cls, open_engine: EngineOpener, request: GenerationRequest, **options) -> ExplorerApp:
        """The explorer over a real engine (loaded on startup by `open_engine(progress)`)."""
        return cls(open_engine=open_engine, request=request, **options)

    @classmethod
    def replaying(cls, header: TraceHeader, events: list, **options) -> ExplorerApp:
        """The explorer over a recorded trace (no model)."""
        return cls(replay=ReplayRun(header, events), **options)

    # -- the run -------------------------------------------------------------------------------

    def _begin(self) -> None:
        # The engine thread needs the GIL back between its kernels; while this thread draws,
        # Python hands it over only every switch interval (5 ms by default). A shorter one
        # keeps a repaint from stalling decode for its whole length.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_S)
        if self.replay is not None:
            self._load_replay_view()
            recorded = next((t.trace.params for t in self.replay.events if getattr(t, "trace", None)), None)
            self.params = recorded or self.params
            self.max_tokens = self.view.admit.max_tokens if self.view.admit else 0
        else:
            self._loading = LoadingScreen()
            self.push_screen(self._loading)
            self._load_engine()

    @property
    def held_step(self) -> int | None:
        """The step (0-based) the live run holds at, as the screen shows it."""
        return self._held

    @property
    def subject(self) -> StepSubject | None:
        """The step the logits panel explains right now."""
        return self._subject()

    # -- the engine ------------------------------------------------------------------------------

    @work(group="loader", exit_on_error=False)
    async def _load_engine(self) -> None:
        assert self._open_engine is not None and self._loading is not None
        screen = self._loading

        def progress(message: str | PullProgress) -> None:
            self.call_from_thread(screen.add_message, message)

        try:
            engine = await self._model_thread.run(self._open_engine, progress)
        except ReqscopeError as exc:
            self._engine_failed(error_text(exc))
            return
        except Exception as exc:  # a bug: on the loading screen, not a silent stall
            self._engine_failed(f"{type(exc).__name__}: {exc}")
            return
        self._engine_ready(engine)

    def _engine_failed(self, message: str) -> None:
        self.load_error = message
        if self._loading is not None:
            self._loading.show_error(message)
        self.notify(message, title="cannot start the engine", severity="error", timeout=30)

    def _engine_ready(self, engine: Engine) -> None:
        self.engine = engine
        self.header = trace_header(engine)
        self._probe = MemoryProbe(engine.device.type, partial(device_memory_bytes, engine.device))
        if self._loading is not None:
            self.pop_screen()
            self._loading = None
        assert self.request is not None
        self._start(self.request, paused=self.start_paused)

    def _start(self, request: GenerationRequest, *, paused: bool) -> None:
        """Run `request`, after the run on screen (if any) has been cancelled and has ended."""
        assert self.engine is not None
        previous = self.live
        if previous is not None:
            previous.cancel()
        self.request = request
        self.params = self._applied = request.sampling
        self.max_tokens = request.max_tokens
        self.view = RunView()
        self.cursor = 0
        self._held = None
        self._preview_cache = None
        self._reported_failure = False
        self.live = LiveRun(self.engine, request, paused=paused, wake=self._wake)
        self._model_thread.submit(self.live.drive, previous)
        self._invalidate()

    def _rerun(self, **changes: object) -> None:
        if self._engine_missing():
            return
        assert self.request is not None
        if "messages" in changes:
            self.measured.clear()  # measurements of another prompt do not compare
        request = renewed(self.request, sampling=self.params, max_tokens=self.max_tokens, **changes)
        self._start(request, paused=self._stepping())

    # -- events in, repaints out ---------------------------------------------------------------

    def _take_events(self) -> None:
        if self.live is not None:
            self._take(self.live)

    def _take(self, live: LiveRun) -> None:
        events = live.take()
        for event in events:
            self.view.apply(event)
            if isinstance(event, PrefillEvent):
                self.prefill_history.append((event.prompt_tokens - event.reused_tokens, event.duration_ms))
            elif isinstance(event, DoneEvent):
                self._finished(event.result)
                self._keep_ttft(event.result)
        if events:
            self._invalidate()
        held = live.held_at if self.view.waiting_step is not None else None
        if held != self._held:
            self._held = held
            self.refresh_bindings()
            self._invalidate()
        if held is not None and self.params != self._applied:
            self._apply_params(live)
        if live.failure and not self._reported_failure:
            self._reported_failure = True
            self.notify(live.failure, title="the engine worker failed", severity="error", timeout=30)
            self._invalidate()

    def _streaming(self) -> bool:
        return self.live is not None and self.view.result is None and self._held is None

    def _apply_params(self, live: LiveRun) -> None:
        try:
            live.update_sampling(self.params)
        except ReqscopeError as exc:
            self.notify(error_text(exc), title="sampling not changed", severity="error")
            self.params = self._applied or self.params
        self._applied = self.params
        self._invalidate()

    def _finished(self, result: RequestResult) -> None:
        if result.error:
            self.notify(result.error, title="request failed", severity="error", timeout=30)

    def _keep_ttft(self, result: RequestResult) -> None:
        metrics = result.engine_metrics or result.metrics
        if metrics is not None and not result.error:
            self.ttft_history.append(
                RunTtft(result.request_id, result.usage.prompt_tokens, result.usage.cached_tokens, metrics.ttft_ms)
            )

    def _ready_to_draw(self) -> bool:
        return self.header is not None  # the engine is still loading

    def _frame(self) -> Frame:
        assert self.header is not None
        request_id = self._request_id()
        latency = latency_figures(self.view)
        measured = measured_layout(self.view, request_id, latency)
        if measured is not None:
            self.measured[measured.layout] = measured
        return Frame(
            header=self.header,
            view=self.view,
            request_id=request_id,
            max_tokens=self.max_tokens,
            params=self._previewing or self.params,
            state=self._state(),
            replay=self.replay is not None,
            latency=latency,
            subject=self._subject(),
            cursor=self.cursor,
            measured=dict(self.measured),
            memory=self._probe.read() if self._probe is not None else None,
            prefill_history=tuple(self.prefill_history),
            ttft_history=tuple(self.ttft_history),
            service_model=self.service_model,
            settings_note="" if self.replay is not None else settings_note(self.request, self.params),
        )

    def _status_line(self, frame: Frame) -> RenderableType:
        return status_text(frame, self.source_name, self.playing)

    def _error_line(self) -> str | None:
        return self.view.error or (self.live.failure if self.live else None)

    def _request_id(self) -> str:
        if self.replay is None and self.request is not None:
            return self.request.request_id
        if self.view.result is not None:
            return self.view.result.request_id
        gateway = self.replay.events[0] if self.replay and self.replay.events else None
        return getattr(gateway, "detail", "") or "replay"

    def _state(self) -> str:
        if self.replay is not None:
            return "replay"
        if self.view.result is not None:
            return self.view.result.finish_reason
        if self.live is None:
            return "loading"
        if self._held is not None:
            return "paused"
        return "pausing" if self.live.pausing else "running"

    # -- the step the logits panel explains ----------------------------------------------------

    def _subject(self) -> StepSubject | None:
        params = self._previewing or self.params
        if self.replay is not None:
            return replay_subject(self.replay, params)
        if self.live is not None and self._held is not None:
            key = (self._held, params)  # a preview filters 49k logits: once per step and settings
            if self._preview_cache is None or self._preview_cache[0] != key:
                self._preview_cache = (key, held_subject(self.live, self._held, params))
            return self._preview_cache[1]
        return last_token_subject(self.view)

    # -- replay --------------------------------------------------------------------------------

    def _load_replay_view(self) -> None:
        assert self.replay is not None
        self.view = self.replay.view()
        self._invalidate()

    @property
    def playing(self) -> bool:
        """True while a replay plays itself forward."""
        return self._play_timer is not None

    def _play_next(self) -> None:
        """Show the next recorded step after the recorded gap (bounded), then schedule the one after."""
        assert self.replay is not None
        self._play_timer = None
        if not self.replay.forward():
            self._invalidate()
            return
        self._load_replay_view()
        low, high = _PLAYBACK_MS
        delay = min(max(self.replay.next_delay_ms(), low), high) / 1000
        self._play_timer = self.set_timer(delay, self._play_next)

    def _stop_playing(self) -> None:
        if self._play_timer is not None:
            self._play_timer.stop()
            self._play_timer = None

    # -- actions -------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in _LIVE_ONLY and self.replay is not None:
            return False
        if action in _REPLAY_ONLY and self.replay is None:
            return False
        if action == "pick":
            return self._held is not None
        return True

    def action_toggle_run(self) -> None:
        """Run freely or pause at the next step (replay: play or stop)."""
        if self.replay is not None:
            if self.playing:
                self._stop_playing()
            else:
                if self.replay.at_end:
                    self.replay.to_start()
                self._play_next()
            self._invalidate()
            return
        live = self._running_live()
        if live is None:
            return
        if live.pausing:
            live.resume()
        else:
            live.pause()
        self._invalidate()

    def action_step(self) -> None:
        """One token forward (live: commit it and hold; running: hold at the next step)."""
        if self.replay is not None:
            self._stop_playing()
            if not self.replay.forward():
                self.notify("end of the recorded run")
            self._load_replay_view()
            return
        live = self._running_live()
        if live is None:
            return
        if self._held is not None:
            self._held = None
            live.step()
        else:
            live.pause()
        self._invalidate()

    def action_step_back(self) -> None:
        """Replay: one step back."""
        if self.replay is None:
            return
        self._stop_playing()
        if not self.replay.back():
            self.notify("already at the first step")
        self._load_replay_view()

    def action_first_step(self) -> None:
        """Replay: the first step."""
        if self.replay is not None:
            self._stop_playing()
            self.replay.to_start()
            self._load_replay_view()

    def action_last_step(self) -> None:
        """Replay: the end of the run."""
        if self.replay is not None:
            self._stop_playing()
            self.replay.to_end()
            self._load_replay_view()

    def action_cursor(self, delta: int) -> None:
        """Move the highlighted candidate."""
        subject = self._subject()
        count = len(subject.trace.candidates) if subject else 1
        self.cursor = min(max(self.cursor + delta, 0), count - 1)
        self._invalidate()

    def action_pick(self) -> None:
        """Commit the highlighted candidate at the held step, then hold at the next one."""
        subject = self._subject()
        if self.live is None or self._held is None or subject is None:
            self.notify("pause first (space or s): a candidate can only be picked at a held step")
            return
        candidate = subject.trace.candidates[min(self.cursor, len(subject.trace.candidates) - 1)]
        try:
            self.live.force_next(candidate.token_id)
        except ReqscopeError as exc:
            self.notify(error_text(exc), severity="error")
            return
        self._held = None
        self.live.step()
        self._invalidate()

    def action_sampling(self) -> None:
        """Open the sampling form (a running request pauses at its next step first)."""
        live = self.live
        if live is not None and self.view.result is None and not live.pausing:
            live.pause()
            self.notify("paused: the new settings apply from the held step on")
        current = SamplingChoice(self.params, self.max_tokens)
        self.push_screen(SamplingForm(current, self._preview_params), self._sampling_chosen)

    def _preview_params(self, params: SamplingParams) -> None:
        self._previewing = params
        self._invalidate()

    def _sampling_chosen(self, choice: SamplingChoice | None) -> None:
        self._previewing = None
        if choice is not None:
            self.params = choice.params
            if self.replay is None:
                self.max_tokens = choice.max_tokens
            if self.live is not None and self._held is not None:
                self._apply_params(self.live)
        self._invalidate()

    def action_cancel(self) -> None:
        """Cancel the request."""
        live = self._running_live()
        if live is not None:
            live.cancel()
            self.notify("cancelling: the request stops before its next model step")

    def _can_edit_prompt(self) -> bool:
        return not self._engine_missing()

    def action_switch_layout(self) -> None:
        """Re-run this request in the other KV cache layout, keeping what this one measured."""
        if self._engine_missing():
            return
        assert self.request is not None
        other = "mha" if self.request.kv_layout == "gqa" else "gqa"
        self.notify(f"running the same request with the {other} cache")
        self._rerun(kv_layout=other)

    def action_export(self) -> None:
        """Write the finished run's files into a new folder under the export root."""
        result = self.view.result
        if result is None:
            self.notify("the request is still running: export when it finishes (c cancels it)")
            return
        events = self.replay.events if self.replay is not None else (self.live.recorded if self.live else [])
        assert self.header is not None
        try:
            folder = claim_run_folder(self.export_root, result.request_id)
            written = export_run(result, folder, list(events), self.header)
        except (ReqscopeError, OSError) as exc:
            self.notify(error_text(exc), title="export failed", severity="error", timeout=15)
            return
        self.last_export = folder
        self.notify(f"{len(written)} files in {folder}", title="exported", timeout=15)

    def _stop(self) -> None:
        if self.live is not None:
            self.live.cancel()
        self._model_thread.shutdown()
        sys.setswitchinterval(self._switch_interval)  # leaving: the UI no longer draws beside decode

    def _running_live(self) -> LiveRun | None:
        if self.live is None or self.view.result is not None:
            self.notify("the request has finished: r runs it again" if self.live else "the engine is loading")
            return None
        return self.live

    def _engine_missing(self) -> bool:
        if self.engine is None:
            self.notify("the engine is not loaded" + (f": {self.load_error}" if self.load_error else ""))
            return True
        return False

    def _stepping(self) -> bool:
        return self.live is not None and self.live.pausing and self.view.result is None

    # -- the command palette -------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for i, name in enumerate(self.DETAIL_VIEWS):
            yield SystemCommand(f"Show {name} panel", f"Small terminals: show the {name} panel [{i + 1}]",
                                partial(self.run_action, f"view({name!r})"))
