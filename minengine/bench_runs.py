"""minengine's timed runs for the benchmark: prefill, the bare greedy loop, and the explorer's path.

The bare loop is what decode costs with nothing watching: `Transformer.forward` and an argmax
that stays on the device. The explorer's path is a full request session with everything the
UI shows switched on (a sampler trace with top candidates every step, per-layer KV accounting,
timeline events). Both are clocked after each model step, like the reference, so their
rates compare the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minengine.bench_timer import StepClock
from minengine.engine import Engine
from minengine.errors import ReqscopeError
from minengine.events import DoneEvent, TokenEvent
from minengine.model import Transformer
from minengine.request import GenerationRequest


@dataclass(frozen=True)
class DecodeRun:
    """Greedy tokens of one decode run and the duration of each decode step (ms)."""

    tokens: tuple[int, ...]
    step_ms: tuple[float, ...]

    @property
    def tokens_per_second(self) -> float:
        """Decode steps per second (one token per step)."""
        return 1000.0 * len(self.step_ms) / sum(self.step_ms)


def prefill_ms(model: Transformer, ids: list[int]) -> float:
    """Time to make a cache and run the prompt `ids` through `model`."""
    clock = StepClock(model.device)
    prompt = torch.tensor(ids, device=model.device)
    clock.mark()
    cache = model.new_cache(len(ids) + 1)
    model.forward(prompt, 0, cache)
    clock.mark()
    elapsed = clock.total_ms()
    cache.release()
    return elapsed


def greedy_decode(model: Transformer, ids: list[int], new_tokens: int) -> DecodeRun:
    """The bare loop: prefill `ids`, then greedy steps until `new_tokens` tokens are chosen."""
    clock = StepClock(model.device)
    cache = model.new_cache(len(ids) + new_tokens)
    try:
        logits = model.forward(torch.tensor(ids, device=model.device), 0, cache)
        clock.mark()
        chosen = [logits.argmax().view(1)]
        for step in range(new_tokens - 1):
            logits = model.forward(chosen[-1], len(ids) + step, cache)
            clock.mark()
            chosen.append(logits.argmax().view(1))
        tokens = tuple(torch.cat(chosen).tolist())
    finally:
        cache.release()
    return DecodeRun(tokens, tuple(clock.durations_ms()))


def explorer_decode(engine: Engine, request: GenerationRequest) -> DecodeRun:
    """Run `request` as a session and clock each token as the consumer receives it.

    The session synchronises each step itself (the sampler needs the token on the host), so
    the host clock is the honest one here on every device.
    """
    clock = StepClock(torch.device("cpu"))
    tokens: list[int] = []
    for event in engine.start(request):
        if isinstance(event, TokenEvent):
            clock.mark()
            tokens.append(event.token_id)
        elif isinstance(event, DoneEvent) and event.result.error:
            raise ReqscopeError(f"the benchmark request failed: {event.result.error}")
    if len(tokens) < 2:
        raise ReqscopeError("the benchmark request produced fewer than 2 tokens; use a prompt with a longer answer")
    return DecodeRun(tuple(tokens), tuple(clock.durations_ms()))
