"""The explorer over the engine: the request runs live, and the keys hold, step, pick and re-run it.

The runs go one after another on the explorer's run thread (`RunThread`), and the engine's model
work on the process's model thread (`minengine.threads.model_thread`). It never calls into the UI
per token: events wait in the run's inbox, and one `RunProgress` message wakes the UI to take
all of them. Repaints are coalesced and, while the engine decodes, paced by `RepaintPacer`
(at most `repaint_hz` a second, and no more than `REPAINT_DUTY` of a core, see `ExplorerBase`),
so a slow terminal repaints less often instead of slowing decode. Every panel draws a bounded
amount, so a repaint costs the same at token 10 and token 10,000.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from minengine.device import device_memory_bytes
from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, Event
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.plan.compute_ceiling import prefill_path_name
from minengine.progress import StatusCallback
from minengine.record.trace_io import trace_header
from minengine.sampling.grammar import needs_grammar
from minengine.text.tools import ToolChoice
from reqscope.bench.ceiling import stored_ceiling, stored_compute_ceiling
from reqscope.engine_load import NO_LOAD, EngineLoad, LoadNote, LoadOptions
from reqscope.ui.base import renewed
from reqscope.ui.keys import LIVE, bindings
from reqscope.ui.run.app import RunExplorer
from reqscope.ui.run.figures.memory_probe import MemoryProbe, MemoryReading
from reqscope.ui.run.formats.comparer import FormatsShown, WeightComparer
from reqscope.ui.run.frame import StepSubject
from reqscope.ui.run.inside.shown import INSPECT_VIEWS, ShownInspection, capture_ask, held_ask, last_inspection
from reqscope.ui.run.live import LiveRun, RunThread
from reqscope.ui.run.loading_screen import LoadingScreen
from reqscope.ui.run.on_screen import RunOnScreen
from reqscope.ui.run.sampling_form import SamplingChoice
from reqscope.ui.run.status_line import settings_note
from reqscope.ui.run.step_subject import last_token_subject
from reqscope.ui.run.view import RunView
from reqscope.wording import error_text

EngineOpener = Callable[[StatusCallback], Engine]
GIL_SWITCH_S = 0.0005


class LiveExplorer(RunExplorer):
    """The explorer over a real engine, loaded on startup by `open_engine(progress)`."""

    BINDINGS = bindings(LIVE)
    RECORDED = False

    def __init__(self, open_engine: EngineOpener, request: GenerationRequest, *, start_paused: bool = False,
                 load: LoadOptions = NO_LOAD, **options: Any) -> None:
        """`start_paused` holds before the first token; `load` puts other requests on the engine beside
        each run (background requests, the served API: `reqscope.engine_load`); `options` go to `RunExplorer`."""
        super().__init__(mode=LIVE, header=None, sampling=SamplingChoice(request.sampling, request.max_tokens),
                         **options)
        self.load_options = load
        self.load: EngineLoad | None = None  # made with the engine, when `load` asks for any
        if load.any:
            self.compact_view = "batch"  # what the load is for: small terminals start on the batch panel
        self.request = request
        self.offered = request  # its tools, which the form may leave out of a rerun and bring back
        self.start_paused = start_paused
        self.engine: Engine | None = None
        self.shown: RunOnScreen | None = None  # None until the engine has loaded
        self._open_engine = open_engine
        self._probe: MemoryProbe | None = None
        self._runs = RunThread()  # loading and every run, in order, off the UI thread
        self.formats = WeightComparer(self._runs.submit, wake=partial(self._wake, True))  # `w`
        self._switch_interval = sys.getswitchinterval()

    @property
    def held_step(self) -> int | None:
        """The step (0-based) the run holds at, as the screen shows it."""
        return self.shown.held if self.shown is not None else None

    # -- the engine ------------------------------------------------------------------------------

    def _begin(self) -> None:
        # The engine thread needs the GIL back between its kernels; while this thread draws,
        # Python hands it over only every switch interval (5 ms by default). A shorter one
        # keeps a repaint from stalling decode for its whole length.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_S)
        loading = LoadingScreen(partial(self._runs.run, self._open_loaded), self._engine_failed)
        self.push_screen(loading, self._engine_ready)

    def _open_loaded(self, progress: StatusCallback) -> Engine:
        """The engine, and the load asked for on it (the API listening): on the run thread, while loading."""
        engine = self._open_engine(progress)
        if self.load_options.any:
            self.load = EngineLoad(engine, self.load_options, self.request)
        return engine

    def _engine_failed(self, message: str) -> None:
        self.load_error = message
        self.notify(message, title="cannot start the engine", severity="error", timeout=30)

    def _engine_ready(self, engine: Engine | None) -> None:
        assert engine is not None  # the loading screen is dismissed with the engine only
        self.engine = engine
        compute = stored_compute_ceiling(engine.device, prefill_path_name(engine)).ceiling
        # The rooflines' ceilings, where measured for this machine (and this model's prefill path).
        self.header = trace_header(engine, stored_ceiling(engine.device).ceiling, compute_ceiling=compute)
        self._probe = MemoryProbe(engine.device.type, partial(device_memory_bytes, engine.device))
        self._start(self.request, paused=self.start_paused)

    # -- the run ---------------------------------------------------------------------------------

    def _start(self, request: GenerationRequest, *, paused: bool) -> None:
        """Run `request`, after the run on screen (if any) has been cancelled and has ended."""
        assert self.engine is not None
        previous = self.shown.run if self.shown is not None else None
        if previous is not None:
            previous.cancel()
        self.formats.cancel()  # a comparison of the run before would hold this one back
        self.request = request
        self.sampling = replace(self.sampling, params=request.sampling, max_tokens=request.max_tokens)
        self.view = RunView()
        self.cursor = 0
        # The background requests join after its first steps and end with it, followed from the
        # worker thread: the screen takes events at its own pace, many steps late under load.
        observe = self.load.follow if self.load is not None else None
        grammar = self.sampling.grammar  # turned off by the form: off from the start of the next run too
        run = LiveRun(self.engine, request, paused=paused, grammar=grammar, wake=self._wake, observe=observe)
        self.shown = RunOnScreen(run, applied=request.sampling, grammar=grammar)
        if self.load is not None:
            self.load.end()  # a run cut short left them running: they join this one after its steps alone
        self._follow_inside()
        self._runs.submit(run.drive, previous)
        self._invalidate()

    def _rerun(self, **changes: object) -> None:
        if self._engine_missing():
            return
        if "messages" in changes:
            self.history.measured.clear()  # measurements of another prompt do not compare
        request = renewed(self.request, sampling=self.sampling.params, max_tokens=self.sampling.max_tokens,
                          **(self._tools() | changes))
        self._start(request, paused=self._stepping())

    def _take_events(self) -> None:
        if self.shown is not None:
            self._take(self.shown)
        if self.formats.take_news():
            self._invalidate()
            self._follow_batch()

    def _take(self, shown: RunOnScreen) -> None:
        events = shown.run.take()
        for event in events:
            self.view.apply(event)
            self.history.record(event)
            if isinstance(event, DoneEvent) and event.result.error:
                self.notify(event.result.error, title="request failed", severity="error", timeout=30)
        if events:
            self._invalidate()
            self._follow_batch()
        if shown.follow(self.view):
            self.refresh_bindings()
            self._invalidate()
            if shown.held is not None and self.load is not None:
                self.load.begin()  # held by the user: the others run meanwhile
        if shown.full_view_arrived():
            self._invalidate()
        if shown.held is not None and self.sampling.params != shown.applied:
            self._apply_params(shown)
        if shown.held is not None and self.sampling.grammar != shown.grammar and needs_grammar(self.request):
            self._apply_grammar(shown)
        if shown.run.failure and not shown.failure_shown:
            shown.failure_shown = True
            self.notify(shown.run.failure, title="the engine worker failed", severity="error", timeout=30)
            self._invalidate()

    def _apply_params(self, shown: RunOnScreen) -> None:
        try:
            shown.apply(self.sampling.params)
        except ReqscopeError as exc:
            self.notify(error_text(exc), title="sampling not changed", severity="error")
            self.sampling = replace(self.sampling, params=shown.applied)
        self._invalidate()

    def _apply_grammar(self, shown: RunOnScreen) -> None:
        """The form's grammar switch, at the held step: the logits panel shows the step with or without the mask."""
        on = self.sampling.grammar
        try:
            shown.set_grammar(on)
        except ReqscopeError as exc:
            self.notify(error_text(exc), title="grammar not changed", severity="error")
            self.sampling = replace(self.sampling, grammar=shown.grammar)
        else:
            step = f"step {shown.held + 1}" if shown.held is not None else "the held step"
            self.notify(f"grammar {'on' if on else 'off'} from {step}: "
                        + ("the next steps are masked again" if on else "the next steps are free"))  # fmt: skip
        self._invalidate()

    def _tools(self) -> dict[str, object]:
        """The request's tools as the form last set them: the offered ones, or none. The output
        schema stays: the form's grammar switch turns it off in the run itself."""
        if self.sampling.tools:
            return {"tools": self.offered.tools, "tool_choice": self.offered.tool_choice}
        return {"tools": (), "tool_choice": ToolChoice()}

    def _streaming(self) -> bool:
        return self.shown is not None and self.view.result is None and self.shown.held is None

    def _stepping(self) -> bool:
        return self.shown is not None and self.shown.run.pausing and self.view.result is None

    def _stop(self) -> None:
        if self.shown is not None:
            self.shown.run.cancel()
        self.formats.cancel()
        if self.load is not None:
            self.load.close()
            self.load = None
        self._runs.shutdown()
        sys.setswitchinterval(self._switch_interval)  # leaving: the UI no longer draws beside decode

    # -- what the frame shows --------------------------------------------------------------------

    def _request_id(self) -> str:
        return self.request.request_id

    def _state(self) -> str:
        if self.view.result is not None:
            return self.view.result.finish_reason
        if self.shown is None:
            return "loading"
        if self.shown.held is not None:
            return "paused"
        return "pausing" if self.shown.run.pausing else "running"

    def _subject(self) -> StepSubject | None:
        if self.shown is None or self.shown.held is None:
            return last_token_subject(self.view)
        return self.shown.subject(self._shown_params())

    def _memory(self) -> MemoryReading | None:
        return self._probe.read() if self._probe is not None else None

    def _settings_note(self) -> str:
        return settings_note(self.request, self.sampling.params)

    def _load_note(self) -> LoadNote | None:
        return self.load.note if self.load is not None else None

    def _batched(self) -> bool:
        return self.load_options.any or self.view.batched

    def _inside_views(self) -> tuple[str, ...]:
        return INSPECT_VIEWS  # the engine captures either whenever asked

    def _inspection(self) -> ShownInspection | None:
        held = self.shown.inspection() if self.shown is not None else None
        return held or last_inspection(self.view)

    def _follow_inside(self) -> None:
        if self.shown is None:
            return
        on = self.inside_on_screen()
        attention, lens = "attention" in on, "lens" in on
        self.shown.run.inspect(capture_ask(attention, lens), held_ask(attention, lens))

    def _formats_shown(self) -> FormatsShown | None:
        return self.formats.shown()

    def _error_line(self) -> str | None:
        return self.view.error or (self.shown.run.failure if self.shown is not None else None)

    def _recorded_events(self) -> list[Event]:
        return list(self.shown.run.recorded) if self.shown is not None else []

    # -- actions ---------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "pick":
            return self.held_step is not None
        return super().check_action(action, parameters)

    def action_toggle_run(self) -> None:
        """Run freely or pause at the next step."""
        shown = self._unfinished()
        if shown is not None:
            shown.toggle()
            self._invalidate()

    def action_step(self) -> None:
        """Commit one token and hold (running: hold at the next step)."""
        shown = self._unfinished()
        if shown is not None:
            shown.step()
            self._invalidate()

    def action_pick(self) -> None:
        """Commit the highlighted candidate at the held step, then hold at the next one."""
        subject = self._subject()
        shown = self.shown
        if shown is None or shown.held is None or subject is None:
            self.notify("pause first (space or s): a candidate can only be picked at a held step")
            return
        candidate = subject.trace.candidates[min(self.cursor, len(subject.trace.candidates) - 1)]
        try:
            shown.pick(candidate.token_id)
        except ReqscopeError as exc:
            self.notify(error_text(exc), severity="error")
            return
        self._invalidate()

    def action_sampling(self) -> None:
        """Open the sampling form (a running request pauses at its next step first)."""
        shown = self.shown
        if shown is not None and self.view.result is None and not shown.run.pausing:
            shown.run.pause()
            self.notify("paused: the new settings apply from the held step on")
        super().action_sampling()

    def _use(self, choice: SamplingChoice) -> None:
        if choice.tools != self.sampling.tools:
            self.notify(("tools " + ("on" if choice.tools else "off") + " from the next run (r): they are written "
                         "into the prompt, so this run keeps its own") if self.offered.tools
                        else "this request has no tools to turn on or off")  # fmt: skip
        grammar_changed = choice.grammar != self.sampling.grammar
        if grammar_changed and not needs_grammar(self.request):
            self.notify("this request has no grammar to turn off or on: no output schema and no tool call it must "
                        "make")  # fmt: skip
        elif grammar_changed and (self.shown is None or self.view.result is not None):
            self.notify(f"grammar {'on' if choice.grammar else 'off'} from the next run (r)")
        self.sampling = choice
        shown = self.shown
        if shown is not None and shown.held is not None:
            self._apply_params(shown)
            if self.sampling.grammar != shown.grammar and needs_grammar(self.request):
                self._apply_grammar(shown)

    def action_cancel(self) -> None:
        """Cancel the request."""
        shown = self._unfinished()
        if shown is not None:
            shown.run.cancel()
            self.notify("cancelling: the request stops before its next model step")

    def _can_edit_prompt(self) -> bool:
        return not self._engine_missing()

    def action_switch_layout(self) -> None:
        """Re-run this request in the other KV cache layout, keeping what this one measured."""
        if self._engine_missing():
            return
        other = "mha" if self.request.kv_layout == "gqa" else "gqa"
        self.notify(f"running the same request with the {other} cache")
        self._rerun(kv_layout=other)

    def action_compare_weights(self) -> None:
        """Run the finished request on screen through the next weight format beside its own, and compare."""
        if self._engine_missing():
            return
        assert self.engine is not None
        result = self.view.result
        if result is None or not result.token_ids:
            self.notify("w compares the finished run's tokens: let the request finish first (c cancels it)"
                        if result is None else "the run made no token to compare")  # fmt: skip
            return
        if self.formats.busy:
            self.notify("a weight-format comparison is running: its figures fill the formats panel")
            return
        option = self.formats.next_format(self.engine)
        if option is None:
            self.notify("no other weight format runs here: the formats panel says why", severity="warning")
        else:
            self.formats.start(option, self.engine, self.request, result.token_ids)
            self.notify(f"running this request's {len(result.token_ids)} tokens through {option.format} "
                        f"beside {self.engine.weights.format}")  # fmt: skip
            self.compact_view = "formats"
        self._fit_layout()

    def _unfinished(self) -> RunOnScreen | None:
        if self.shown is None or self.view.result is not None:
            self.notify("the request has finished: r runs it again" if self.shown else "the engine is loading")
            return None
        return self.shown

    def _engine_missing(self) -> bool:
        if self.engine is None:
            self.notify("the engine is not loaded" + (f": {self.load_error}" if self.load_error else ""))
            return True
        return False
