"""The run explorer: one request on screen, live from the engine or replayed from a trace.

Two apps stand on `RunExplorer`: `LiveExplorer` (`reqscope.ui.run.live_app`) runs the request on
the engine, and `ReplayExplorer` (`reqscope.ui.run.replay_app`) walks a recorded trace. What
they share is here: the panels, the frame every panel draws from, the candidate cursor, the
sampling form, the export and the palette's panel commands. Each mode supplies its run: the
state word, the step the logits panel explains, what its keys do and where its events are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from rich.console import RenderableType
from textual.app import SystemCommand
from textual.screen import Screen

from minengine.engine.events import Event
from minengine.errors import ReqscopeError
from minengine.record.export import export_run
from minengine.record.trace_io import TraceHeader
from minengine.sampling.params import SamplingParams
from reqscope.engine_load import LoadNote
from reqscope.ui.base import ExplorerBase
from reqscope.ui.run.export_folder import DEFAULT_ROOT, claim_run_folder
from reqscope.ui.run.figures.latency import latency_figures
from reqscope.ui.run.figures.memory_probe import MemoryReading
from reqscope.ui.run.frame import Frame, StepSubject
from reqscope.ui.run.history import RunHistory
from reqscope.ui.run.inside.focus import AttentionFocus
from reqscope.ui.run.inside.shown import INSPECT_VIEWS, ShownInspection
from reqscope.ui.run.panels.attention import AttentionPanel
from reqscope.ui.run.panels.batch import BatchPanel
from reqscope.ui.run.panels.formats import FormatsPanel
from reqscope.ui.run.panels.kv import KVPanel
from reqscope.ui.run.panels.latency import LatencyPanel
from reqscope.ui.run.panels.layout import LayoutPanel
from reqscope.ui.run.panels.lens import LensPanel
from reqscope.ui.run.panels.logits import LogitsPanel
from reqscope.ui.run.panels.pipeline import PipelinePanel
from reqscope.ui.run.panels.readout import ReadoutPanel
from reqscope.ui.run.panels.template import TemplatePanel
from reqscope.ui.run.panels.tokens import TokensPanel
from reqscope.ui.run.sampling_form import SamplingChoice, SamplingForm
from reqscope.ui.run.status_line import status_text
from reqscope.ui.run.view import RunView
from reqscope.wording import error_text

if TYPE_CHECKING:  # numpy, only for a fit given with --service-model
    from minengine.plan.service_model import ServiceModel
    from reqscope.ui.run.formats.comparer import FormatsShown


class RunExplorer(ExplorerBase):
    """What a live run and a replay share; a mode supplies the hooks at the end."""

    PIPELINE = PipelinePanel
    READOUT = ReadoutPanel
    BODY = (("tokens", TokensPanel), ("logits", LogitsPanel), ("kv", KVPanel), ("latency", LatencyPanel),
            ("layouts", LayoutPanel), ("template", TemplatePanel), ("attention", AttentionPanel),
            ("lens", LensPanel), ("batch", BatchPanel), ("formats", FormatsPanel))
    DETAIL_VIEWS = ("logits", "kv", "layouts", "latency", "template")
    # The batch panel while other requests share the engine (`_batched`); the step's inside
    # (attention, lens) where the run can show it (`_inside_views`); formats once `w` compared
    # weight formats (`_formats_shown`)
    OPTIONAL_VIEWS = ("batch", *INSPECT_VIEWS, "formats")
    VIEW_LABELS = {"attention": "attn"}  # the small terminals' hint line is short of room
    RECORDED: ClassVar[bool]  # whether the run on screen is a recording (the panels say so)

    def __init__(
        self,
        *,
        mode: str,
        header: TraceHeader | None,
        sampling: SamplingChoice,
        export_root: Path = DEFAULT_ROOT,
        repaint_hz: float = 30.0,  # the most repaints a second; fewer when drawing is slow
        service_model: ServiceModel | None = None,  # a `reqscope calibrate` fit: its prefill beside the measured
    ) -> None:
        super().__init__(mode=mode, repaint_hz=repaint_hz)
        self.export_root = export_root
        self.service_model = service_model
        self.header = header  # the model and the cache it ran with; None until the engine has loaded
        self.view = RunView()
        self.sampling = sampling  # the settings the next steps use, and the token limit
        self.previewing: SamplingParams | None = None  # typed in the form, not applied yet
        self.cursor = 0  # the highlighted candidate
        self.history = RunHistory()
        self.last_export: Path | None = None
        self._laid_out: tuple[str, ...] = ()  # the detail panels of the layout last fitted
        self.inside_focus = AttentionFocus()  # the layer (and head) the attention detail and the lens show

    @property
    def subject(self) -> StepSubject | None:
        """The step the logits panel explains right now."""
        return self._subject()

    # -- repaints ------------------------------------------------------------------------------

    def _ready_to_draw(self) -> bool:
        return self.header is not None  # the engine is still loading

    def _frame(self) -> Frame:
        assert self.header is not None
        request_id = self._request_id()
        latency = latency_figures(self.view)
        self.history.measure(self.view, request_id, latency)
        return Frame(
            header=self.header,
            view=self.view,
            request_id=request_id,
            max_tokens=self.sampling.max_tokens,
            params=self._shown_params(),
            state=self._state(),
            replay=self.RECORDED,
            latency=latency,
            subject=self._subject(),
            cursor=self.cursor,
            measured=dict(self.history.measured),
            memory=self._memory(),
            prefill_history=tuple(self.history.prefill),
            ttft_history=tuple(self.history.ttft),
            service_model=self.service_model,
            settings_note=self._settings_note(),
            load=self._load_note(),
            inspection=self._inspection(),
            focus=self.inside_focus,
            formats=self._formats_shown(),
        )

    def _status_line(self, frame: Frame) -> RenderableType:
        return status_text(frame)

    def _error_line(self) -> str | None:
        return self.view.error

    def _shown_params(self) -> SamplingParams:
        return self.previewing or self.sampling.params

    # -- actions both modes have ---------------------------------------------------------------

    def action_cursor(self, delta: int) -> None:
        """Move the highlighted candidate."""
        subject = self._subject()
        count = len(subject.trace.candidates) if subject else 1
        self.cursor = min(max(self.cursor + delta, 0), count - 1)
        self._invalidate()

    def action_sampling(self) -> None:
        """Open the sampling form; every valid edit is previewed on the step the logits panel explains."""
        self.push_screen(SamplingForm(self.sampling, preview=self._preview), self._sampling_chosen)

    def _preview(self, choice: SamplingChoice) -> None:
        self.previewing = choice.params
        self._invalidate()

    def _sampling_chosen(self, choice: SamplingChoice | None) -> None:
        self.previewing = None
        if choice is not None:
            self._use(choice)
        self._invalidate()

    def _use(self, choice: SamplingChoice) -> None:
        """Apply the settings chosen in the form (a replay re-filters with them; its token limit is recorded)."""
        self.sampling = replace(self.sampling, params=choice.params)

    def action_export(self) -> None:
        """Write the finished run's files into a new folder under the export root."""
        result = self.view.result
        if result is None:
            self.notify("the request is still running: export when it finishes (c cancels it)")
            return
        assert self.header is not None
        try:
            folder = claim_run_folder(self.export_root, result.request_id)
            written = export_run(result, folder, self._recorded_events(), self.header)
        except (ReqscopeError, OSError) as exc:
            self.notify(error_text(exc), title="export failed", severity="error", timeout=15)
            return
        self.last_export = folder
        self.notify(f"{len(written)} files in {folder}", title="exported", timeout=15)

    # -- the batch panel ---------------------------------------------------------------------------

    def _detail_views(self) -> tuple[str, ...]:
        inside = self._inside_views()
        return (self.DETAIL_VIEWS + tuple(v for v in INSPECT_VIEWS if v in inside)
                + (("batch",) if self._batched() else ())
                + (("formats",) if self._formats_shown() is not None else ()))

    def _fit_layout(self, size=None) -> None:
        self._laid_out = self._detail_views()
        body = self.query_one("#body")
        body.set_class("batch" in self._laid_out, "-batched")
        body.set_class(bool(self._inside_views()), "-inside")
        body.set_class("formats" in self._laid_out, "-formats")
        super()._fit_layout(size)
        # small terminals: the token panel shrinks to its counts and a strip while an inside panel shows
        self.query_one("#body").set_class(self.compact_view in INSPECT_VIEWS, "-inside-shown")
        self._follow_inside()

    def action_view(self, name: str) -> None:
        """Show one detail panel on small terminals (the batch panel once other requests share the engine)."""
        if name == "formats" and name not in self._detail_views():
            self.notify("the weight formats panel shows once w has compared this request in another format")
            return
        if name not in self._detail_views():
            self.notify(self._missing_view(name))
            return
        super().action_view(name)

    def _missing_view(self, name: str) -> str:
        """Why the optional panel `name` is not there."""
        if name == "batch":
            return ("the batch panel shows when other requests share the engine: run with --background N "
                    "or --serve-port PORT, or replay a trace of such a run")  # fmt: skip
        return (f"this trace has no {'attention' if name == 'attention' else 'logit lens'} records: record a run "
                f"with them ({'--attention N' if name == 'attention' else '--lens'} with --json or --export, "
                f"or export from the explorer with the panel on screen)")

    # -- the step's inside ---------------------------------------------------------------------

    def inside_on_screen(self) -> tuple[str, ...]:
        """The inside panels (attention, lens) on screen now: what the run should capture."""
        views = self._detail_views()
        wide = self.wide
        return tuple(v for v in INSPECT_VIEWS if v in views and (wide or self.compact_view == v))

    def action_focus_layer(self, delta: int) -> None:
        """Move the layer the attention detail and the lens show."""
        layers = self.header.layers if self.header is not None else 1
        self.inside_focus = self.inside_focus.clamped(layers, self._q_heads()).moved_layer(delta, layers)
        self._invalidate(now=True)

    def action_focus_head(self, delta: int) -> None:
        """Move the head the attention detail shows (through the mean over the layer's heads)."""
        heads, layers = self._q_heads(), self.header.layers if self.header is not None else 1
        self.inside_focus = self.inside_focus.clamped(layers, heads).moved_head(delta, heads)
        self._invalidate(now=True)

    def _q_heads(self) -> int:
        shown = self._inspection()
        attention = shown.inspection.attention if shown is not None else None
        if attention is not None:
            return attention.q_heads
        return self.header.q_heads if self.header is not None else 1

    def _follow_batch(self) -> None:
        """Lay the panels out again once the run on screen turns out to share the engine (or no longer does)."""
        if self._detail_views() != self._laid_out:
            self._fit_layout()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for name in self._detail_views():
            yield SystemCommand(f"Show {name} panel", f"Small terminals: show the {name} panel [{self.view_key(name)}]",
                                partial(self.run_action, f"view({name!r})"))

    # -- hooks ---------------------------------------------------------------------------------

    def _request_id(self) -> str:
        """The id of the request on screen."""
        raise NotImplementedError

    def _state(self) -> str:
        """Where the run on screen stands, in a word ("running", "paused", "replay", a finish reason...)."""
        raise NotImplementedError

    def _subject(self) -> StepSubject | None:
        """The step the logits panel explains, under the settings shown."""
        raise NotImplementedError

    def _memory(self) -> MemoryReading | None:
        """The device's memory now, where it is measured."""
        return None

    def _settings_note(self) -> str:
        """Where the settings in force came from, for the status line."""
        return ""

    def _load_note(self) -> LoadNote | None:
        """The load this explorer puts on its engine (background requests, the served API), if any."""
        return None

    def _formats_shown(self) -> FormatsShown | None:
        """The weight formats compared (`w`), where any were asked for."""
        return None

    def _batched(self) -> bool:
        """Whether the batch panel applies: the request on screen shares its engine."""
        raise NotImplementedError

    def _recorded_events(self) -> list[Event]:
        """Every event of the run on screen, for the export."""
        raise NotImplementedError

    def _inside_views(self) -> tuple[str, ...]:
        """The inside panels (of "attention", "lens") the run on screen can show."""
        raise NotImplementedError

    def _inspection(self) -> ShownInspection | None:
        """The step's inside the attention and lens panels show, if any."""
        raise NotImplementedError

    def _follow_inside(self) -> None:
        """The inside panels on screen changed (or may have): a live run captures for them."""
