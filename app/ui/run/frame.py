"""One repaint's worth of state: what every panel draws from, gathered once per frame."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minengine.record.trace_io import TraceHeader
from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import StepTrace
from reqscope.engine_load import LoadNote
from reqscope.ui.run.figures.latency import LatencyFigures, RunTtft
from reqscope.ui.run.figures.layout_compare import MeasuredLayout
from reqscope.ui.run.figures.memory_probe import MemoryReading
from reqscope.ui.run.inside.focus import AttentionFocus
from reqscope.ui.run.inside.shown import ShownInspection
from reqscope.ui.run.view import RunView

if TYPE_CHECKING:  # numpy, only for a fit given with --service-model
    from minengine.plan.service_model import ServiceModel
    from reqscope.ui.run.formats.comparer import FormatsShown


@dataclass(frozen=True)
class StepSubject:
    """The step the logits panel explains, and how to label it."""

    trace: StepTrace
    label: str  # e.g. "step 5 waiting: preview", "token 12 committed"
    pickable: bool  # candidates may be forced as the next token (live run, held step)
    path: str = ""  # the way the step's arithmetic ran (`minengine.steps.step_path`), where known


@dataclass(frozen=True)
class Frame:
    """Everything drawn in one repaint."""

    header: TraceHeader
    view: RunView
    request_id: str
    max_tokens: int
    params: SamplingParams  # what the next steps use (may differ from the request's)
    state: str  # "running", "paused", "done", "cancelled", "error", "replay"
    replay: bool
    latency: LatencyFigures  # computed once per repaint for every panel that shows it
    subject: StepSubject | None = None
    cursor: int = 0  # highlighted candidate row in the logits panel
    measured: dict[str, MeasuredLayout] = field(default_factory=dict)
    memory: MemoryReading | None = None
    prefill_history: tuple[tuple[int, float], ...] = ()  # (prompt tokens computed, prefill ms) per run
    ttft_history: tuple[RunTtft, ...] = ()  # every finished live run's TTFT, with what the prefix cache reused
    service_model: ServiceModel | None = None  # a `reqscope calibrate` fit: predicted beside measured
    settings_note: str = ""  # where the sampling values came from, e.g. "set: k · default: T p"
    load: LoadNote | None = None  # what else runs in the engine (--background, --serve-port); None: nothing asked
    inspection: ShownInspection | None = None  # the step's attention and lens the panels show, if any
    focus: AttentionFocus = AttentionFocus()  # the layer (and head) the attention detail and the lens follow
    formats: FormatsShown | None = None  # the weight formats compared with `w` (live runs); None: none asked
