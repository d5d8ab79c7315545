"""The fair comparison's rounds: each engine in its own process, as its users run it, alternated.

- reqscope is the `reqscope --json` command with its own default OpenMP policy (`omp_env`);
- transformers is `generate()` in a plain Python process (`hf_child`) with the environment the
  user had before reqscope touched it: never with a policy reqscope chose for itself (under the
  PASSIVE policy reqscope used to set, transformers was measured at 16-17 tokens/s instead of 25);
- peers (llama.cpp, `peers`) run the same way, each in its own process.

All get the same chat prompt's token ids, greedy decoding and the same token limit, and their
decode rate is measured the same way: token lines stamped on arrival at the parent (`pipes`),
first token excluded. One discarded round first (page cache, the layout cache of a first
reqscope run), then rounds in alternating order (A B C, C B A, ...), ratios taken within each
round. Optionally the whole comparison runs again beside one busy process (a spinning Python
loop), where engines whose OpenMP workers spin collapse (transformers 24 -> 3-10 tokens/s here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from minengine.errors import ReqscopeError
from reqscope.bench.fair.pipes import ChildEnvironment, StreamedRun, stream_run
from reqscope.bench.stats import Parity, Spread, parity_of, ratios

REQSCOPE = "reqscope"
TRANSFORMERS = "transformers"
IDLE = "idle machine"
UNDER_LOAD = "beside one busy process"


@dataclass(frozen=True)
class Contender:
    """One side of the comparison: how to launch it, and what is known about it beforehand."""

    name: str
    how: str  # one line: how it runs, e.g. "`reqscope --json`, its own default policy"
    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)  # exactly what the child is started with
    bytes_per_token: float | None = None  # what one decode step reads, when known (else what the child reports)
    environment: ChildEnvironment | None = None  # when the child does not report its own


@dataclass(frozen=True)
class SideResult:
    """One side's figures over the measured rounds."""

    name: str
    how: str
    environment: ChildEnvironment
    tokens: int  # tokens generated in the first measured round (the limit, or fewer at end of sequence)
    prompt_tokens: int | None
    decode_tokens_per_s: Spread  # from arrival times at the parent, first token excluded
    vs_transformers: Spread  # this side's decode rate / transformers', per round
    first_token_ms: Spread | None  # the child's own clock: request to first token (after load)
    bytes_per_token: float | None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens over the median request-to-first-token time (prefill plus first sample)."""
        if self.first_token_ms is None or not self.prompt_tokens or self.first_token_ms.median <= 0:
            return None
        return self.prompt_tokens / (self.first_token_ms.median / 1000)


@dataclass(frozen=True)
class FairComparison:
    """Every side, measured through pipes under one condition (idle, or beside a busy process)."""

    condition: str
    rounds: int
    new_tokens: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    sides: tuple[SideResult, ...]
    parity: Parity  # reqscope's greedy tokens against transformers'
    skipped: tuple[str, ...]  # a line per peer that did not run, and why

    def side(self, name: str) -> SideResult:
        """The side called `name`."""
        for s in self.sides:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def decode_speedup(self) -> Spread:
        """reqscope's decode rate over transformers', per round: the headline."""
        return self.side(REQSCOPE).vs_transformers


def run_fair(
    contenders: list[Contender],
    rounds: int,
    new_tokens: int,
    *,
    condition: str = IDLE,
    skipped: tuple[str, ...] = (),
    progress: Callable[[str], None] = lambda message: None,
) -> FairComparison:
    """Launch every contender once to warm up, then `rounds` times in alternating order."""
    names = [c.name for c in contenders]
    if REQSCOPE not in names or TRANSFORMERS not in names:
        raise ReqscopeError("the fair comparison needs a reqscope side and a transformers side")
    load_before = os.getloadavg()
    progress(f"fair comparison ({condition}): warm-up round")
    for c in contenders:
        stream_run(c.name, c.argv, c.env)
    runs: dict[str, list[StreamedRun]] = {name: [] for name in names}
    for r in range(rounds):
        progress(f"fair comparison ({condition}): round {r + 1} of {rounds}")
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            run = stream_run(c.name, c.argv, c.env)
            if len(run.tokens) < 2:
                raise ReqscopeError(f"{c.name} sent {len(run.tokens)} token(s); a decode rate needs at least 2")
            runs[c.name].append(run)
    theirs = [run.decode_tokens_per_s for run in runs[TRANSFORMERS]]
    sides = tuple(_side(c, runs[c.name], theirs) for c in contenders)
    return FairComparison(
        condition=condition,
        rounds=rounds,
        new_tokens=new_tokens,
        load_before=load_before,
        load_after=os.getloadavg(),
        sides=sides,
        parity=parity_of(runs[REQSCOPE][0].tokens, runs[TRANSFORMERS][0].tokens),
        skipped=skipped,
    )


def _side(c: Contender, runs: list[StreamedRun], theirs: list[float]) -> SideResult:
    rates = [run.decode_tokens_per_s for run in runs]
    environment = c.environment or runs[0].environment
    if environment is None:
        raise ReqscopeError(f"{c.name} reported no environment and none was probed")
    firsts = [run.first_token_ms for run in runs if run.first_token_ms is not None]
    return SideResult(
        name=c.name,
        how=c.how,
        environment=environment,
        tokens=len(runs[0].tokens),
        prompt_tokens=runs[0].prompt_tokens,
        decode_tokens_per_s=Spread.of(rates),
        vs_transformers=Spread.of(ratios(rates, theirs)),
        first_token_ms=Spread.of(firsts) if firsts else None,
        bytes_per_token=c.bytes_per_token if c.bytes_per_token is not None else _reported_bytes(runs[0]),
    )


def _reported_bytes(run: StreamedRun) -> float | None:
    """What the child said a decode step read, averaged over its steps (None when it did not say)."""
    return sum(run.bytes_read) / len(run.bytes_read) if run.bytes_read else None


def probe_environment(env: dict[str, str]) -> ChildEnvironment:
    """What `reqscope` runs with under `env`: policy, threads, torch (see `probe`)."""
    run = stream_run("the environment probe", [sys.executable, "-m", "reqscope.bench.fair.probe"], env, timeout_s=300)
    if run.environment is None:
        raise ReqscopeError("the environment probe reported nothing")
    return run.environment


@contextmanager
def busy_neighbour(env: dict[str, str]) -> Iterator[None]:
    """One other process spinning on a core for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], env=env)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()
