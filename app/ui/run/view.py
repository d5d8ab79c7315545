"""What the explorer knows about one request: the events seen so far, folded into one record.

Live runs and replays feed the same fold, so every panel draws from one place and a replay
draws exactly what the live run drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minengine.engine import events as ev
from minengine.engine.timeline import ALL_STAGES
from minengine.kv.usage import KVUsage
from reqscope.ui.request_view import RequestView

# The pipeline as the explorer shows it: the engine's stages (the prefix cache stage between
# admit and prefill included) plus `stream`, the span from the first to the last visible token
# (decode and streaming interleave, one token at a time).
PIPELINE: tuple[str, ...] = (*ALL_STAGES[:-1], "stream", ALL_STAGES[-1])
# A trace recorded before the prefix cache has no such stage: its pipeline is drawn without it.
PIPELINE_WITHOUT_PREFIX_CACHE: tuple[str, ...] = tuple(name for name in PIPELINE if name != "prefix_cache")


@dataclass
class RunView(RequestView[ev.Event]):
    """Everything drawn about one request, updated one event at a time."""

    stages: dict[str, ev.StageEvent] = field(default_factory=dict)
    prompt: ev.PromptEvent | None = None
    admit: ev.AdmitEvent | None = None
    prefix_cache: ev.PrefixCacheEvent | None = None  # None before the stage, and in older traces
    prefill: ev.PrefillEvent | None = None
    tokens: list[ev.TokenEvent] = field(default_factory=list)
    held_totals: list[float] = field(default_factory=list)  # ms held in all as of each token (see `held_ms`)
    waiting_step: int | None = None  # index of the step whose logits are waiting, if any
    waiting_path: str = ""  # the way that step ran (`minengine.steps.step_path`)
    preemptions: list[tuple[int, ev.PreemptEvent]] = field(default_factory=list)  # (tokens out before it, the event)
    shared_steps: int = 0  # decode steps so far that this request shared with other sequences
    last_inspected: ev.TokenEvent | None = None  # the latest token whose step's inside was captured
    result: ev.RequestResult | None = None
    events_seen: int = 0

    def apply(self, event: ev.Event) -> None:
        """Fold one event in."""
        self.events_seen += 1
        if isinstance(event, ev.StageEvent):
            self.stages[event.name] = event
        elif isinstance(event, ev.PromptEvent):
            self.prompt = event
        elif isinstance(event, ev.AdmitEvent):
            self.admit = event
        elif isinstance(event, ev.PrefixCacheEvent):
            self.prefix_cache = event
        elif isinstance(event, ev.PrefillEvent):
            self.prefill = event
        elif isinstance(event, ev.StepReady):
            self.waiting_step, self.waiting_path = event.index, event.path
        elif isinstance(event, ev.TokenEvent):
            self.tokens.append(event)
            if event.batch is not None and event.batch.sequences > 1:
                self.shared_steps += 1
            self.held_totals.append((self.held_totals[-1] if self.held_totals else 0.0) + event.held_ms)
            if event.inspection is not None:
                self.last_inspected = event
            self.waiting_step = None
        elif isinstance(event, ev.PreemptEvent):
            self.preemptions.append((len(self.tokens), event))
        elif isinstance(event, ev.DoneEvent):
            self.result = event.result
            self.waiting_step = None

    # -- derived -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the request finished (any finish reason)."""
        return self.result is not None

    @property
    def kv(self) -> KVUsage | None:
        """The latest KV snapshot: after the last token, else after prefill."""
        if self.tokens:
            return self.tokens[-1].kv
        return self.prefill.kv if self.prefill else None

    @property
    def batched(self) -> bool:
        """True once the request is seen sharing the engine: a step with other sequences, a prompt
        prefilled in several chunks, or a preemption (never for a request alone, nor an older trace)."""
        chunks = self.prefill.chunks if self.prefill is not None else ()
        return bool(self.shared_steps or self.preemptions or len(chunks) > 1
                    or any(c.step.sequences > 1 for c in chunks))

    @property
    def held_ms(self) -> float:
        """Time the run was held at a step (paused, stepped) so far: wall-clock time that is not the engine's."""
        if self.result is not None:
            return self.result.held_ms
        return self.held_totals[-1] if self.held_totals else 0.0

    @property
    def visible_tokens(self) -> list[ev.TokenEvent]:
        """Tokens that made text visible (the ones a client would have seen streamed)."""
        return [t for t in self.tokens if t.text]

    def current_stage(self) -> str | None:
        """The stage in progress (None once the request completed)."""
        if self.result is not None:
            return None
        if "prefill" in self.stages:
            return "decode"
        for name in self.pipeline():
            if name not in self.stages and name != "stream":
                return name
        return None

    def pipeline(self) -> tuple[str, ...]:
        """The stages to draw: without the prefix cache for a run that prefilled without one (an older trace)."""
        if "prefill" in self.stages and "prefix_cache" not in self.stages:
            return PIPELINE_WITHOUT_PREFIX_CACHE
        return PIPELINE

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache (0 without a hit, and in older traces)."""
        if self.prefix_cache is not None:
            return self.prefix_cache.reused_tokens
        return self.prefill.reused_tokens if self.prefill is not None else 0

    def stage_ms(self, name: str) -> float | None:
        """A stage's duration so far; running stages count up to the latest token."""
        if name == "stream":
            visible = self.visible_tokens
            return visible[-1].t_ms - visible[0].t_ms if visible else None
        if name in self.stages:
            return self.stages[name].duration_ms
        if name == "decode" and "prefill" in self.stages and self.tokens:
            return self.tokens[-1].t_ms - self.stages["prefill"].end_ms
        return None

    def stage_detail(self, name: str) -> str:
        """The short note the engine attached to a stage (token counts, queue wait...)."""
        if name == "stream":
            return f"{len(self.visible_tokens)} chunks"
        event = self.stages.get(name)
        return event.detail if event else ""

    @property
    def text(self) -> str:
        """The answer as streamed so far (the final text once done)."""
        if self.result is not None:
            return self.result.text
        return "".join(t.text for t in self.tokens)

    @property
    def error(self) -> str | None:
        """The request's error message, when it failed."""
        return self.result.error if self.result else None
