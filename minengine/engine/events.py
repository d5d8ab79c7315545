"""What one request emits as it moves through the engine, in order.

A consumer (the plain printer, the JSON printer, the UI, the server) iterates a request
session and receives these. Each is a frozen record; none holds tensors, so events can be
handed to another thread or serialised as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.batch_facts import BatchStep, BatchSummary, PreemptEvent, PrefillChunk
from minengine.engine.metrics import RequestMetrics
from minengine.engine.roofline import StepBytes
from minengine.engine.timeline import StageTiming, TimelineEvent
from minengine.inspect.records import StepInspection
from minengine.kv.usage import KVUsage
from minengine.sampling.step_trace import StepTrace
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
    # The part each prompt token belongs to (`parts` counts them): what the attention view marks
    # a position as (`minengine.inspect.positions`). Empty in traces recorded before it was kept.
    token_parts: tuple[str, ...] = ()


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
class PrefixCacheEvent:
    """The prefix cache stage: the prompt's full blocks looked up, the cached prefix copied in.

    Blocks [0, blocks_hit) of the prompt are shared, copied from blocks kept after earlier
    requests; the rest of the prompt (`computed_tokens`, at least its last token) is prefilled
    as new blocks. With the cache off (`enabled` False, `note` says why) nothing is looked up.
    """

    enabled: bool
    prompt_tokens: int
    block_size: int
    blocks_looked_up: int  # the prompt's full blocks a hit may cover (never the last prompt token)
    blocks_hit: int  # the longest run of them found, from the first
    reused_tokens: int  # blocks_hit x block_size: prompt tokens not prefilled
    lookup_ms: float  # hashing and looking the blocks up (done at admission, before the reservation)
    copy_ms: float  # copying the hit into this request's cache
    duration_ms: float  # the stage: making the cache and copying the hit in
    kept_blocks: int  # blocks the prefix cache holds, every model layout and dtype together
    kept_bytes: int
    note: str = ""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefill computes."""
        return self.prompt_tokens - self.reused_tokens


@dataclass(frozen=True)
class PrefillEvent:
    """Prefill ran over the prompt (over its part after the reused prefix, when there is one)."""

    prompt_tokens: int
    duration_ms: float
    kv: KVUsage
    # Prompt tokens whose K/V came from the prefix cache: prefill computed the positions from
    # here on. 0 without a hit (and in traces recorded before the prefix cache).
    reused_tokens: int = 0
    # The steps the computed part ran in, one chunk per step (one chunk unless the step budget
    # split the prompt); empty in traces recorded before the engine batched.
    chunks: tuple[PrefillChunk, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, committed and (if it made text visible) streamed."""

    index: int  # 0-based position among generated tokens
    token_id: int
    piece: str
    text: str  # text this token made visible (may be empty: held back or special)
    t_ms: float
    itl_ms: float | None  # gap since the previous token event
    step_ms: float  # model + sampling time for this token (a hold at its StepReady left out)
    kv: KVUsage
    trace: StepTrace | None
    forced: bool = False
    # Time the consumer held the session at a pause point since the previous token (since the
    # request was sent, for the first): part of `itl_ms` on the wall clock, none of the engine's
    # own time. Its ITL on the engine's clock is itl_ms - held_ms. 0 when nobody paused the run
    # (and in traces recorded before it was kept).
    held_ms: float = 0.0
    # What the decode step behind this token read (`minengine.engine.roofline`): None for the
    # first token, which prefill produced, and in traces recorded before it was kept.
    bytes_read: StepBytes | None = None
    # The engine step behind this token as this request saw it: who shared it, what it
    # scheduled, the queue and the KV pool. None for the first token (prefill's; see
    # PrefillEvent.chunks) and in traces recorded before the engine batched.
    batch: BatchStep | None = None
    # What the step behind this token did inside (its attention, its logit lens, their cost),
    # when the session was asked to capture it (`RequestSession.inspect`); None otherwise, and
    # in traces recorded before it was kept.
    inspection: StepInspection | None = None
    # The way the step behind this token ran (`minengine.steps.step_path`; prefill's last chunk for
    # the first token); empty in traces recorded before it was kept.
    path: str = ""
    # This token ends the request, as far as its stream knows: a stop token or string, or the
    # max_tokens-th (not a cancel, nor the model's context running out; False in older traces).
    last: bool = False

    @property
    def read_step_ms(self) -> float:
        """The time `bytes_read` was read in: the shared forward when other sequences shared the
        step (their waits and sampling are not the step's), else this token's own step."""
        if self.batch is not None and self.batch.sequences > 1 and self.batch.bytes_read is not None:
            return self.batch.step_ms
        return self.step_ms


@dataclass(frozen=True)
class StepReady:
    """Logits for the next token are computed and waiting to be sampled (a pause point)."""

    index: int
    # The way the step that made these logits ran (`minengine.steps.step_path`); empty in traces
    # recorded before it was kept.
    path: str = ""


@dataclass(frozen=True)
class Usage:
    """Token accounting, as OpenAI-style APIs report it."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens).
    cached_tokens: int = 0


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
    # `metrics` are on the wall clock, as a client of the engine would have seen them. When the
    # run was paused or stepped, the time its consumer held it (`held_ms` in all) is in those
    # gaps; `engine_metrics` apply the same formulas to the token times with it taken out.
    # Equal to `metrics` when nobody held the run; None in traces recorded before they were kept.
    engine_metrics: RequestMetrics | None = None
    held_ms: float = 0.0
    # The request's prefix cache stage (None when it never got that far, and in traces
    # recorded before the prefix cache); `usage.cached_tokens` is its reused_tokens.
    prefix_cache: PrefixCacheEvent | None = None
    # The steps it shared with other requests, its prefill chunks and preemptions (None when it
    # never reached prefill, and in traces recorded before the engine batched).
    batch: BatchSummary | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The request finished; `result` holds everything measured."""

    result: RequestResult


Event = (
    StageEvent
    | PromptEvent
    | AdmitEvent
    | PrefixCacheEvent
    | PrefillEvent
    | TokenEvent
    | StepReady
    | PreemptEvent
    | DoneEvent
)
