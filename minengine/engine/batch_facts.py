"""What one request sees of the batch it shares steps with: records the step loop hands its sessions.

The engine runs many requests in shared steps (`minengine.engine.step_loop`). Each step is one
forward pass over every sequence scheduled in it: one token for each running request, plus
prompt chunks of requests still in prefill, within the step's token budget. A request's events
carry the facts of the steps it was part of, from its own point of view: how many sequences
shared the step, what the step scheduled, how long it ran, the queue behind it, and how the KV
pool was divided when it ran. None holds a tensor; all are torch-free, so the endpoint path and
the trace readers can import them.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.roofline import StepBytes
from minengine.kv.usage import PoolUsage


@dataclass(frozen=True)
class BatchStep:
    """One engine step, as the request it produced a token (or a prompt chunk) for saw it."""

    step: int  # the engine's step counter
    sequences: int  # sequences that shared the step, this one included
    decode_tokens: int  # tokens the step scheduled as decode: one per running sequence in it
    prefill_tokens: int  # prompt tokens the step scheduled as prefill chunks
    waiting: int  # requests waiting for admission when the step was planned
    step_ms: float  # the forward pass's wall time
    solo_step_ms: float | None  # a recent decode step with one sequence alone, on this engine (None: none yet)
    pool: PoolUsage
    # What the whole step read: the weights once for every sequence in it, and each decode
    # row's K/V (None for a step of one sequence, whose token event carries its own bytes).
    bytes_read: StepBytes | None = None
    # The way the step's arithmetic ran (`minengine.steps.step_path`): "c-stack int16×q4_1",
    # "torch rows", "reference"; empty in traces recorded before it was kept.
    path: str = ""

    @property
    def scheduled_tokens(self) -> int:
        """Every token the step ran, decode and prefill together."""
        return self.decode_tokens + self.prefill_tokens


@dataclass(frozen=True)
class PrefillChunk:
    """A piece of a request's prompt, prefilled in one step (beside whatever else shared it)."""

    start: int  # the first position the chunk covered
    tokens: int
    step: BatchStep


@dataclass(frozen=True)
class PreemptEvent:
    """The engine took this request's KV back to make room for others; it will be recomputed.

    Emitted in the request's stream when it happens. The request goes back to the front of the
    queue; when it runs again its prompt and the tokens it had produced are prefilled anew
    (recompute, as vLLM and nano-vllm preempt), so no token is lost or repeated.
    """

    reason: str
    blocks_freed: int
    bytes_freed: int
    tokens_to_recompute: int
    t_ms: float


@dataclass(frozen=True)
class BatchSummary:
    """A finished request's batch facts, for its result, `reqscope` report and telemetry record."""

    steps: int  # engine steps that ran this request (prefill chunks and decode steps)
    shared_steps: int  # of them, steps it shared with at least one other sequence
    mean_batch: float  # sequences per step over its steps
    max_batch: int
    prefill_chunks: int
    preemptions: int

    @classmethod
    def of(cls, steps: list[BatchStep], prefill_chunks: int, preemptions: int) -> BatchSummary:
        """The summary of a request that ran in `steps`."""
        sizes = [s.sequences for s in steps]
        return cls(
            steps=len(sizes),
            shared_steps=sum(1 for n in sizes if n > 1),
            mean_batch=sum(sizes) / len(sizes) if sizes else 0.0,
            max_batch=max(sizes, default=0),
            prefill_chunks=prefill_chunks,
            preemptions=preemptions,
        )
