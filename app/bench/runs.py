"""minengine's timed runs for the benchmark: prefill, the bare greedy loop, and the explorer's path.

The bare loop is what decode costs with nothing watching: `ModelRunner.forward` and an argmax
that stays on the device. The explorer's path is a full request session with everything the
UI shows switched on (a sampler trace with top candidates every step, per-layer KV accounting,
timeline events). For the overhead the two decode side by side, one step of each in turn
(`explorer_beside_bare`): a slow spell of the machine then lands on both instead of on
whichever happened to run during it, which on a shared 2-core machine moved the figure by
several percent from one run to the next.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from minengine.engine.engine import Engine
from minengine.engine.events import DoneEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.steps.model_runner import ModelRunner
from reqscope.bench.read_probe import ReadProbe
from reqscope.bench.timer import StepClock


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


def prefill_ms(runner: ModelRunner, ids: list[int]) -> float:
    """Time to make a cache and run the prompt `ids` through `runner`."""
    clock = StepClock(runner.device)
    prompt = torch.tensor(ids, device=runner.device)
    clock.mark()
    cache = runner.new_cache(len(ids) + 1)
    runner.forward(prompt, 0, cache)
    clock.mark()
    elapsed = clock.total_ms()
    cache.release()
    return elapsed


def greedy_decode(runner: ModelRunner, ids: list[int], new_tokens: int) -> DecodeRun:
    """The bare loop: prefill `ids`, then greedy steps until `new_tokens` tokens are chosen."""
    clock = StepClock(runner.device)
    cache = runner.new_cache(len(ids) + new_tokens)
    try:
        logits = runner.forward(torch.tensor(ids, device=runner.device), 0, cache)
        clock.mark()
        chosen = [logits.argmax().view(1)]
        for step in range(new_tokens - 1):
            logits = runner.forward(chosen[-1], len(ids) + step, cache)
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
    does too (its sampler needs the token on the host). Prefills are not clocked. Both runs make
    as many tokens as the session does. With CUDA graphs the two cannot interleave (decode runs
    in one K/V arena, lent to one cache at a time), so there the session runs first, then the
    bare loop.
    """
    session = _session_steps(engine, request)
    bare = _bare_steps(engine.runner, ids, request.max_tokens)
    try:
        if engine.runner.static_decoder is None:
            pairs = [(step, next(bare)) for step in session]
        else:
            explorer = list(session)
            pairs = [(step, next(bare)) for step in explorer]
    finally:
        bare.close()
    if len(pairs) < 2:
        raise ReqscopeError("the benchmark request produced fewer than 2 tokens; use a prompt with a longer answer")
    return _run(pair[1] for pair in pairs), _run(pair[0] for pair in pairs)


def _run(steps: Iterable[tuple[int, float | None]]) -> DecodeRun:
    steps = list(steps)
    return DecodeRun(tuple(t for t, _ in steps), tuple(ms for _, ms in steps if ms is not None))


def _session_steps(engine: Engine, request: GenerationRequest) -> Iterator[tuple[int, float | None]]:
    """(token, ms) per token of a session; the first token ends the prefill and is not timed (None)."""
    first = True
    resumed = time.perf_counter()
    for event in engine.start(request):
        if isinstance(event, DoneEvent) and event.result.error:
            raise ReqscopeError("the benchmark request failed: ", event.result.error)
        if isinstance(event, TokenEvent):
            yield event.token_id, None if first else (time.perf_counter() - resumed) * 1000
            first = False
            resumed = time.perf_counter()  # the consumer's time between tokens is not the session's


def _bare_steps(runner: ModelRunner, ids: list[int], max_tokens: int) -> Iterator[tuple[int, float | None]]:
    """(token, ms) per token of the bare loop, up to `max_tokens`; the prefill's token is not timed."""
    cache = runner.new_cache(len(ids) + max_tokens)
    try:
        current = runner.forward(torch.tensor(ids, device=runner.device), 0, cache).argmax().view(1)
        yield int(current), None
        for pos in range(len(ids), len(ids) + max_tokens - 1):
            start = time.perf_counter()
            current = runner.forward(current, pos, cache).argmax().view(1)
            token = int(current)
            yield token, (time.perf_counter() - start) * 1000
    finally:
        cache.release()


def decode_beside_probes(runner: ModelRunner, ids: list[int], new_tokens: int, probe: ReadProbe) -> RooflineRun:
    """The bare greedy loop with one matvec and one sum pass of `probe` after every decode step.

    Each is clocked alone on the host (a step ends when its token is read back, a probe pass
    synchronises the device), so decode and probe see the machine at the same moments and both
    are averages over the same span. The alternative, a best-of-N probe taken before a decode
    run, sets a quiet moment's bandwidth against a whole run's and moved the fraction by tens of
    points on a shared machine. A step streams every weight anyway, so a probe pass between
    steps leaves the next step nothing warmer or colder.
    """
    steps = _bare_steps(runner, ids, new_tokens)
    decode_ms = matvec = total = 0.0
    try:
        for _, ms in steps:
            if ms is not None:  # the prefill's token is not a decode step
                decode_ms += ms
                matvec += probe.matvec_seconds()
                total += probe.sum_seconds()
    finally:
        steps.close()
    return RooflineRun(new_tokens - 1, decode_ms / 1000, probe.nbytes, matvec, total)
