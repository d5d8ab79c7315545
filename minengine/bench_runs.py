"""minengine's timed runs for the benchmark: prefill, the bare greedy loop, and the explorer's path.

The bare loop is what decode costs with nothing watching: `Transformer.forward` and an argmax
that stays on the device. The explorer's path is a full request session with everything the
UI shows switched on (a sampler trace with top candidates every step, per-layer KV accounting,
timeline events). For the overhead the two decode side by side, one step of each in turn
(`explorer_beside_bare`): a slow spell of the machine then lands on both instead of on
whichever happened to run during it, which on a shared 2-core machine moved the figure by
several percent from one run to the next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minengine.bench_timer import StepClock
from minengine.device import synchronize
from minengine.engine import Engine
from minengine.errors import ReqscopeError
from minengine.events import DoneEvent, TokenEvent
from minengine.model import Transformer
from minengine.request import GenerationRequest
from minengine.roofline import ReadProbe


@dataclass(frozen=True)
class DecodeRun:
    """Greedy tokens of one decode run and the duration of each decode step (ms)."""

    tokens: tuple[int, ...]
    step_ms: tuple[float, ...]

    @property
    def tokens_per_second(self) -> float:
        """Decode steps per second (one token per step)."""
        return 1000.0 * len(self.step_ms) / sum(self.step_ms)


@dataclass(frozen=True)
class RooflineRun:
    """Decode steps and read-bandwidth probe passes taken in turn, each summed over the run."""

    steps: int
    decode_seconds: float  # the decode steps alone
    probe_bytes: int  # one probe pass
    matvec_seconds: float  # all matvec passes (one after each step)
    sum_seconds: float  # all sum passes (one after each step)

    @property
    def tokens_per_second(self) -> float:
        """Decode steps per second, probes excluded."""
        return self.steps / self.decode_seconds

    @property
    def matvec_bytes_per_second(self) -> float:
        """Read bandwidth of the matvec passes."""
        return self.steps * self.probe_bytes / self.matvec_seconds

    @property
    def sum_bytes_per_second(self) -> float:
        """Read bandwidth of the sum passes."""
        return self.steps * self.probe_bytes / self.sum_seconds


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


def explorer_beside_bare(engine: Engine, request: GenerationRequest, ids: list[int]) -> tuple[DecodeRun, DecodeRun]:
    """(bare, explorer): `request`'s session and the bare loop over the prompt `ids`, stepped in turn.

    After each token the session yields, the bare loop takes its own step for the same position,
    so step k of each runs next to step k of the other. Each step is clocked alone on the host:
    the explorer's from its resumption to its next token (model step, trace, KV accounting,
    events), the bare loop's as forward + argmax + reading the token back, which the session
    does too (its sampler needs the token on the host). Prefills are not decode steps and are
    not clocked. Both runs make as many tokens as the session does.
    """
    model = engine.model
    bare_tokens: list[int] = []
    explorer_tokens: list[int] = []
    bare_ms: list[float] = []
    explorer_ms: list[float] = []
    cache = model.new_cache(len(ids) + request.max_tokens)
    try:
        current = model.forward(torch.tensor(ids, device=model.device), 0, cache).argmax().view(1)
        bare_tokens.append(int(current))
        resumed = time.perf_counter()
        for event in engine.start(request):
            if isinstance(event, DoneEvent) and event.result.error:
                raise ReqscopeError(f"the benchmark request failed: {event.result.error}")
            if not isinstance(event, TokenEvent):
                continue
            if explorer_tokens:  # the first token ends the session's prefill
                explorer_ms.append((time.perf_counter() - resumed) * 1000)
                start = time.perf_counter()
                current = model.forward(current, len(ids) + len(bare_tokens) - 1, cache).argmax().view(1)
                bare_tokens.append(int(current))
                bare_ms.append((time.perf_counter() - start) * 1000)
            explorer_tokens.append(event.token_id)
            resumed = time.perf_counter()
    finally:
        cache.release()
    if len(explorer_tokens) < 2:
        raise ReqscopeError("the benchmark request produced fewer than 2 tokens; use a prompt with a longer answer")
    return DecodeRun(tuple(bare_tokens), tuple(bare_ms)), DecodeRun(tuple(explorer_tokens), tuple(explorer_ms))


def decode_beside_probes(model: Transformer, ids: list[int], new_tokens: int, probe: ReadProbe) -> RooflineRun:
    """The bare greedy loop with one matvec and one sum pass of `probe` after every decode step.

    Each is clocked alone (host clock, device synchronised), so decode and probe see the machine
    at the same moments and both are averages over the same span. The alternative, a best-of-N
    probe taken before a decode run, sets a quiet moment's bandwidth against a whole run's and
    moved the fraction by tens of points on a shared machine. A step streams every weight
    anyway, so a probe pass between steps leaves the next step nothing warmer or colder.
    """
    cache = model.new_cache(len(ids) + new_tokens)
    decode = matvec = total = 0.0
    try:
        current = model.forward(torch.tensor(ids, device=model.device), 0, cache).argmax().view(1)
        for step in range(new_tokens - 1):
            synchronize(model.device)
            start = time.perf_counter()
            current = model.forward(current, len(ids) + step, cache).argmax().view(1)
            synchronize(model.device)
            decode += time.perf_counter() - start
            matvec += probe.matvec_seconds()
            total += probe.sum_seconds()
    finally:
        cache.release()
    return RooflineRun(new_tokens - 1, decode, probe.nbytes, matvec, total)
