"""What one request emits as it moves through the engine, in order.

A consumer (the plain printer, the JSON printer, the UI, the server) iterates a request
session and receives these. Each is a frozen record; none holds tensors, so events can be
handed to another thread or serialised as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.metrics import RequestMetrics
from minengine.engine.timeline import StageTiming, TimelineEvent
from minengine.kv.cache import KVUsage
from minengine.sampling.sampler import StepTrace
from minengine.text.prompt_parts import PromptPart
from minengine.text.tokenizer import TokenPiece


@dataclass(frozen=True)
class StageEvent:
    """A lifecycle stage finished (gateway, template, tokenize, admit, prefill, decode, complete)."""

    name: str
    start_ms: float
    end_ms: float
    detail: str = ""

    @property
    def duration_ms(self) -> float:
        """How long the stage took."""
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class PromptEvent:
    """The rendered chat template and its tokens (after tokenization)."""

    rendered: str
    pieces: tuple[TokenPiece, ...]
    parts: tuple[PromptPart, ...]


@dataclass(frozen=True)
class AdmitEvent:
    """The scheduler admitted the request: its budgets and the time it waited."""

    prompt_tokens: int
    max_tokens: int
    context_limit: int
    kv_needed_bytes: int
    kv_budget_bytes: int
    queue_ms: float


@dataclass(frozen=True)
class PrefillEvent:
    """Prefill ran over the whole prompt."""

    prompt_tokens: int
    duration_ms: float
    kv: KVUsage


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, committed and (if it made text visible) streamed."""

    index: int  # 0-based position among generated tokens
    token_id: int
    piece: str
    text: str  # text this token made visible (may be empty: held back or special)
    t_ms: float
    itl_ms: float | None  # gap since the previous token event
    step_ms: float  # model + sampling time for this token
    kv: KVUsage
    trace: StepTrace | None
    forced: bool = False


@dataclass(frozen=True)
class StepReady:
    """Logits for the next token are computed and waiting to be sampled (a pause point)."""

    index: int


@dataclass(frozen=True)
class Usage:
    """Token accounting, as OpenAI-style APIs report it."""

    prompt_tokens: int
    completion_tokens: int


FINISH_REASONS = ("stop", "length", "stop_sequence", "cancelled", "error")


@dataclass(frozen=True)
class RequestResult:
    """Everything measured about one finished request."""

    request_id: str
    finish_reason: str  # one of FINISH_REASONS
    text: str
    token_ids: tuple[int, ...]
    usage: Usage
    timeline: tuple[TimelineEvent, ...]
    stages: tuple[StageTiming, ...]
    metrics: RequestMetrics | None  # None when no visible token was produced
    queue_ms: float
    kv_peak: KVUsage | None
    sampler_order: tuple[str, ...]
    error: str | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The request finished; `result` holds everything measured."""

    result: RequestResult


Event = StageEvent | PromptEvent | AdmitEvent | PrefillEvent | TokenEvent | StepReady | DoneEvent
