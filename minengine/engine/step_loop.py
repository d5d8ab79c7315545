"""The engine's step loop: every running request's next forward, in shared steps.

Continuous batching as vLLM's V1 scheduler does it. One thread owns the model. Each admitted
request joins the loop as a `Member` and hands it work: its prompt (after any reused prefix),
then one token per decode step. Each step the loop plans within two limits (`BatchLimits`):
every running sequence's next token first, in the order they joined, then prompt chunks of
requests still prefilling, first come first served, until the step's token budget or its
sequence cap is used up. One forward pass runs them all (`shared_step`), so each weight is
read once for everyone; a prompt longer than what is left of the budget is split over steps
(chunked prefill), so a long prompt never stalls the requests that are decoding.

A request's session still runs on its consumer's thread: it samples its own rows with its own
parameters, streams its own text, and blocks in `Member.forward` only while its work waits for
and runs in a step. Every step runs on the process's model thread (`threads.model_thread`), the
one the engine loaded on: GNU OpenMP gives each thread that opens a parallel region a team of
its own, and with two teams on a 2-core machine every region waits for a sleeping worker
(`threads.ModelThread`): the same 8-row step took 88 ms on a second thread against 50 on the
loader's. So a consumer hands its work in and, when no drive of the steps is queued, queues
one; a caller already on the model thread runs the steps itself. A session whose consumer
holds it (a person stepping the explorer) has no work in the loop, so the others go on without
it. Before a step the loop gives the sequences
the last one served a moment (`gather_s`) to hand in their next token, so that sequences
decoding together stay in the same steps instead of drifting into alternate ones; a sequence
marked `away` (held) is not waited for.

A request no one steers (a server's) runs ahead instead (`Member.run_ahead`,
`minengine.engine.run_ahead`): the step that finishes its work also chooses its next token, on
the model thread, and hands it in at once, so the loop never waits for that request's consumer;
what each step gave it is posted to its `Ahead` as the next step's compute begins. It leaves the
loop whenever its consumer is done (a stop string), and a step still running it is waited for
first, so its blocks never go back while a step writes them.

Each step is described to every member it served as a `BatchStep` (minengine.engine.batch_facts).

Before a step runs, every paged cache in it gets the blocks its tokens need (`_room_for`). When
the pool has none left, the newest member holding blocks is preempted by recompute, as vLLM and
nano-vllm do: its blocks go back to the pool and its forward ends with `Preempted`, and its
session hands in everything it had fed again, from position 0, as a prompt. A prompt chunk never
preempts an older member: it waits for room.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minengine.device import synchronize
from minengine.engine.batch_facts import BatchStep, PrefillChunk
from minengine.engine.burst import BURST_STEP_TOKENS, Bursts
from minengine.engine.chunk_cost import ChunkCost
from minengine.engine.roofline import StepBytes, kv_position_bytes
from minengine.engine.run_ahead import Ahead, Chosen, Decoded, TokenChooser, prepare_choices
from minengine.errors import Mention, RequestError, Setting
from minengine.fast.panel_kernels import activations
from minengine.kv.block_pool import PoolExhausted
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.usage import PoolUsage
from minengine.sampling.logit_summary import LogitSummary, summarize
from minengine.steps.model_runner import ModelRunner
from minengine.steps.rows import Row, RowObserver
from minengine.threads import model_thread

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's: the most sequences a step runs when no cap is given (see `default_limits`)
IDLE_TOKEN_BUDGET = 2048  # the CPU default's budget while no sequence decodes (`BatchLimits.idle_batched_tokens`)
_SOLO_HISTORY = 16  # solo decode steps the loop remembers for `BatchStep.solo_step_ms`
# How long a step waits for the sequences the last one served, as a fraction of that step's time
# (at least `gather_s`): 8 greedy streams on the 2-core development machine ran in steps of 6.3
# sequences on average with a fixed 4 ms, their consumers still sampling when the step began.
GATHER_STEP_FRACTION = 0.25


class StepCancelled(Exception):
    """The request was cancelled while its prompt was still being prefilled in chunks."""


class Preempted(Exception):
    """The loop took the request's KV blocks back for others; its session recomputes what it had fed."""

    def __init__(self, reason: str, blocks_freed: int, bytes_freed: int) -> None:
        super().__init__(reason)
        self.reason, self.blocks_freed, self.bytes_freed = reason, blocks_freed, bytes_freed


@dataclass(frozen=True)
class BatchLimits:
    """What one step may hold: vLLM's `max_num_seqs` and `max_num_batched_tokens`.

    `idle_batched_tokens`, when set, is the token budget of a step while no sequence decodes: the
    budget exists to keep decode steps short beside a long prompt, and with no one decoding
    chunks only cost (on the CPU a 1,025-token prompt prefilled in one step takes 0.7x the time
    of 17 steps of 64). `attention_counted`: beside decoding sequences, a prompt chunk's attention
    over its context counts against the budget too (`chunk_cost`), so that a chunk far into a long
    prompt takes fewer tokens and the step stays near its usual cost. The CPU's default limits set
    both; a budget given by name stays a hard cap on tokens alone, as in vLLM.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    idle_batched_tokens: int | None = None
    attention_counted: bool = False

    def check(self, block_size: int = 16) -> None:
        """Refuse limits no step can work under, for KV blocks of `block_size` tokens (a one-line
        error naming the setting, its value and what would do)."""
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if seqs < 1:
            raise RequestError(
                Mention(Setting.MAX_NUM_SEQS, str(seqs)),
                " lets no sequence into a step, so no request could ever run; give it 1 or more",
            )
        if tokens < block_size:
            raise RequestError(
                Mention(Setting.MAX_NUM_BATCHED_TOKENS, str(tokens)),
                f" is smaller than one KV block ({block_size} tokens), so a step could never fill one; raise ",
                Setting.MAX_NUM_BATCHED_TOKENS,
                f" to at least {block_size}",
            )
        if tokens < seqs:
            raise RequestError(
                Mention(Setting.MAX_NUM_BATCHED_TOKENS, str(tokens)),
                " is smaller than ",
                Mention(Setting.MAX_NUM_SEQS, str(seqs)),
                ", so a step could not give every running sequence its token; raise ",
                Setting.MAX_NUM_BATCHED_TOKENS,
                f" to at least {seqs} or lower ",
                Setting.MAX_NUM_SEQS,
            )


CPU_TOKEN_BUDGET = 80
# Where the products multiply float32 rows (a CPU without VNNI's dot products, or float32 asked for), a
# plain 16-row decode step is already bound by the FMAs, so each prompt row beside it adds nearly its
# whole cost, and 80 rows made a step far dearer than a plain one (docs/lab/long-prompt.md, a Zen 3 EPYC).
FLOAT_ROWS_TOKEN_BUDGET = 56


def default_token_budget(device: torch.device) -> int:
    """The step's token budget when none is given: small on a CPU, where prefill is compute-bound
    (a 64-token chunk costs a few decode steps there), vLLM's chunked-prefill default on a GPU.
    The CPU's trades a long prompt's TTFT beside sixteen decoding streams against the streams' p99
    gap over their median: with the rounded chunk kernel, 80 rows put the TTFT under vLLM's in most
    runs with the gap within 3x at its median, where 64 kept the gap lower and the TTFT at about
    vLLM's; where the products multiply float32 rows, 56 rows with the chunk kernel kept the gap where
    80 rows had it before the kernel, with a lower TTFT (docs/lab/long-prompt.md)."""
    if device.type != "cpu":
        return 2048
    return FLOAT_ROWS_TOKEN_BUDGET if activations() == "float32" else CPU_TOKEN_BUDGET


def default_limits(
    device: torch.device, max_num_seqs: int | None, max_num_batched_tokens: int | None
) -> BatchLimits:
    """The limits for the flags as given: a budget named stays a hard cap; the default one on a CPU
    grows to 2,048 tokens (the GPU's) in a step while no sequence decodes, and beside decoding
    sequences counts a prompt chunk's attention (`BatchLimits.attention_counted`). Without `max_num_seqs`
    as many sequences run as the KV pool holds and a step's token budget can give a token each
    (vLLM's 256 at most): admission is by capacity, not by a fixed count of slots."""
    tokens = default_token_budget(device) if max_num_batched_tokens is None else max_num_batched_tokens
    seqs = max(1, min(DEFAULT_MAX_NUM_SEQS, tokens)) if max_num_seqs is None else max_num_seqs
    if max_num_batched_tokens is not None:
        return BatchLimits(seqs, tokens)
    if tokens >= IDLE_TOKEN_BUDGET:
        return BatchLimits(seqs, tokens)
    return BatchLimits(seqs, tokens, IDLE_TOKEN_BUDGET, attention_counted=True)


@dataclass(eq=False)
class _Work:
    """One member's forward, waiting for (or part way through) the steps that run it."""

    member: Member
    ids: tuple[int, ...]
    start: int
    done: int = 0  # tokens of `ids` already run
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    chunks: list[PrefillChunk] = field(default_factory=list)
    finished: bool = False
    ready: threading.Event | None = None  # set with `finished`, for a consumer that waits on it (not a run ahead's)
    observer: RowObserver | None = None  # shown its last position inside the step that ends it (inspection)
    summarize: int | None = None  # top candidates its logits' summary keeps (`logit_summary`); None: none
    summary: LogitSummary | None = None
    ahead: Ahead | None = None  # its member runs ahead: the step chooses its next token and feeds it back
    handed_in: float = field(default_factory=time.perf_counter)

    @property
    def left(self) -> int:
        return len(self.ids) - self.done


class Member:
    """One running request's place in the loop: its cache, and the steps it ran in."""

    def __init__(self, loop: StepLoop, cache: KVCache, order: int, cancelled: threading.Event, reserved: int) -> None:
        self.loop = loop
        self.cache = cache
        self.order = order  # join order: earlier members are served first
        self.cancelled = cancelled
        self.reserved_bytes = reserved  # what admission set aside for it
        self.decoding = False  # its prompt is in: its work is one decode token a step
        self.away = False  # its consumer holds it: the loop does not wait for its next token
        self.steps: list[BatchStep] = []  # every step it had tokens in
        self.prefill_chunks = 0
        self.preemptions = 0
        self.preempted: Preempted | None = None  # taken back while it had no work in the loop
        self.last_step: BatchStep | None = None
        self.summary: LogitSummary | None = None  # of the logits the last forward returned, when asked
        self.ahead: Ahead | None = None  # the loop runs it ahead of its consumer (`run_ahead`)

    def forward(
        self, ids: tuple[int, ...], start: int, observer: RowObserver | None = None, summarize: int | None = None
    ) -> tuple[torch.Tensor, list[PrefillChunk]]:
        """Run `ids` at positions from `start` in the loop's steps; the next-token logits and, for a
        prompt, the chunks it ran in. Blocks until the last of its steps has run. Raises
        `Preempted` when its blocks were taken back: the caller runs everything again from 0.
        `observer` is shown the last position inside its step (its own row of a shared step).
        With `summarize` (a top-candidate count) the step also summarizes the logits for a greedy
        trace, with every other row that asks, into `summary`."""
        self.away = False
        self.summary = None
        work = _Work(self, ids, start, observer=observer, summarize=summarize, ready=threading.Event())
        self.loop._run_until_done(work)  # ends at once with `Preempted` if it was taken back meanwhile
        if work.error is not None:
            raise work.error
        assert work.logits is not None
        self.summary = work.summary
        return work.logits, work.chunks

    def run_ahead(self, ids: tuple[int, ...], start: int, chooser: TokenChooser) -> Ahead:
        """Hand in `ids` at positions from `start`, and go on without the consumer
        (`minengine.engine.run_ahead`): after each of its steps the loop chooses the next token
        with `chooser` on the model thread, posts a `Decoded` to the returned `Ahead` and feeds
        the token back at the next position, until the chooser says it is the last, the request
        is cancelled (None is posted then), or it leaves. Preempted, it posts `Preempted` and
        stops: the consumer runs ahead again from position 0 with everything it had fed."""
        self.away = False
        return self.loop._run_ahead(self, ids, start, chooser)

    def decoded(self, ahead: Ahead) -> Decoded | None:
        """The next step `ahead` ran (None: it stopped), waited for; raises what ended it (`Preempted`,
        a failed step). On the model thread, by running the steps until one comes."""
        loop = self.loop
        if model_thread().here() and not ahead.ready():
            with loop._cond:
                loop._drive(ahead.ready)
                loop._drive_later()
        return ahead.take()

    def leave(self) -> None:
        """The request is done with the loop (whatever the ending): work it still had in the loop
        is dropped, and a step running it is waited for before the cache can go back."""
        self.loop._leave(self)

    @functools.cached_property
    def position_bytes(self) -> int:
        """K/V bytes each of its cached positions adds to a decode step's read (its cache's layout
        and storage decide it, once: the cache's whole `usage` took 20-30 us a row and step)."""
        return kv_position_bytes(self.cache.usage())


class StepLoop:
    """The thread that runs every member's work in shared steps; see the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        limits: BatchLimits,
        *,
        waiting: Callable[[], int] = lambda: 0,
        pool: Callable[[Member, list[Member]], PoolUsage] | None = None,
        gather_s: float = 0.004,
        weight_bytes: int = 0,
    ) -> None:
        """`waiting` counts requests in the admission queue; `pool` reports the KV budget as one
        member sees it beside the others. `gather_s`: how long a step waits for the sequences
        the last one served. `weight_bytes`: what a step reads of the weights (for the roofline of
        a shared step)."""
        limits.check()
        self.runner = runner
        self.limits = limits
        self._chunk_cost = ChunkCost.of_model(runner.model.cfg, getattr(runner.model, "ops", None))
        self._bursts = Bursts()
        self.waiting = waiting
        self.pool = pool or (lambda m, _: PoolUsage(m.reserved_bytes, m.reserved_bytes, 0, 0))
        self.gather_s = gather_s
        self.weight_bytes = weight_bytes
        self.steps_run = 0
        self.preemptions = 0  # since the start, every member's
        self._order = itertools.count()
        self._members: list[Member] = []
        self._pending: list[_Work] = []
        self._last_served: set[Member] = set()
        self._solo_ms: deque[float] = deque(maxlen=_SOLO_HISTORY)
        self._last_step_s = 0.0  # the last step's forward, which `_gather` waits a fraction of
        self._cond = threading.Condition()
        self._driving = False  # a drive of the steps is queued on, or running on, the model thread
        self._in_step: set[Member] = set()  # the members of the step running now (outside the lock)
        self._holding: list[Ahead] = []  # runs ahead with items held until the next step computes (`Ahead.hold`)

    # -- members -------------------------------------------------------------------------------

    def join(self, cache: KVCache, cancelled: threading.Event, reserved_bytes: int = 0) -> Member:
        """A new running request over `cache`; `cancelled` stops its chunked prefill between steps."""
        with self._cond:
            member = Member(self, cache, next(self._order), cancelled, reserved_bytes)
            self._members.append(member)
            return member

    def _leave(self, member: Member) -> None:
        with self._cond:
            member.ahead = None  # first: the step running now feeds it nothing more
            while member in self._in_step:  # the step writes its K/V: the cache goes back after it
                self._cond.wait()
            for work in [w for w in self._pending if w.member is member]:
                self._finish(work)  # a run ahead's next token: no one will read it
            if member in self._members:
                self._members.remove(member)
            self._last_served.discard(member)
            self._cond.notify_all()

    @property
    def running(self) -> int:
        """Requests joined and not yet left."""
        return len(self._members)

    def set_limits(self, limits: BatchLimits) -> None:
        """Plan the steps from now on within `limits` (checked first)."""
        limits.check()
        with self._cond:
            self.limits = limits

    # -- the loop ------------------------------------------------------------------------------

    def _run_until_done(self, work: _Work) -> None:
        """Hand in `work` and wait until the steps the process's model thread runs have done it."""
        steps = model_thread()
        with self._cond:
            # Under the lock, as `_preempt` sets it: checked before, a preemption between the check
            # and the hand-in would let this work run at its old positions over blocks given back.
            member = work.member
            if member.preempted is not None:
                work.error, member.preempted = member.preempted, None
                self._finish(work, pending=False)
                return
            self._hand_in(work)
            if steps.here():  # a caller on the model thread itself: it runs the steps, for everyone
                self._drive(lambda: work.finished)
                self._drive_later()
                return
        # Each consumer waits on its own work's event: on the loop's condition every step's end and
        # every hand-in woke all 8 consumers of a shared step to find their work not yet done.
        assert work.ready is not None
        work.ready.wait()

    def _hand_in(self, work: _Work) -> None:
        """Under the lock: queue `work`, and a drive of the steps unless one is queued or runs (or
        the caller is the model thread, which drives them itself)."""
        self._pending.append(work)
        self._cond.notify_all()  # the model thread may be gathering the step's sequences
        if not model_thread().here():
            self._drive_later()

    def _drive_later(self) -> None:
        """Under the lock: queue a drive on the model thread for work pending and not driven. A drive
        runs until nothing is pending, so one queued serves every work handed in before it ends."""
        if self._pending and not self._driving:
            self._driving = True
            model_thread().submit(self._drive_all)

    def _run_ahead(self, member: Member, ids: tuple[int, ...], start: int, chooser: TokenChooser) -> Ahead:
        ahead = Ahead(chooser)
        with self._cond:
            if member.preempted is not None:  # taken back meanwhile: its positions are gone
                ahead.post(member.preempted)
                member.preempted = None
                return ahead
            member.ahead = ahead
            self._hand_in(_Work(member, ids, start, summarize=chooser.summarize, ahead=ahead))
        return ahead

    def _drive_all(self) -> None:
        """On the model thread: run steps while any member has work pending, and no other model
        work waits: requests that run ahead always have work pending, so a drive steps aside
        between two steps for what else was queued on the thread (a step's inspection, a load)
        and queues itself again behind it."""
        steps = model_thread()
        with self._cond:
            try:
                self._drive(lambda: not self._pending or steps.others_waiting())
            except BaseException as exc:  # a fault outside a step's forward: fail the work, never hang it
                for work in list(self._pending):
                    work.error = exc
                    self._finish(work)
                raise
            finally:
                self._release()
                self._driving = False
                self._drive_later()
                self._cond.notify_all()

    def _drive(self, done: Callable[[], bool]) -> None:
        """Under the lock, on the model thread: plan and run steps until `done()`. Only this thread
        runs steps, so two never overlap."""
        while not done():
            self._gather()
            plan = self._room_for(self._plan())
            if not plan and self._bursts.stop():  # a burst's prompts found no room: decode first
                continue
            if not plan:
                self._release()
                if self._pending:
                    self._cond.wait(0.05)  # all of it waits for blocks: until someone leaves or hands in work
                continue
            waiting, members = self.waiting(), list(self._members)
            self._in_step = {w.member for w, _ in plan}
            self._cond.release()
            try:
                with torch.inference_mode():
                    self._step(plan, waiting, members)
            finally:
                self._cond.acquire()
                self._in_step = set()
            self._cond.notify_all()
        self._release()

    def _hold(self, ahead: Ahead, item: Decoded | BaseException | None) -> None:
        """On the model thread: post `item` to `ahead` when the next step's compute begins (`Ahead` says why)."""
        if not ahead.holds:
            self._holding.append(ahead)
        ahead.hold(item)

    def _release(self) -> None:
        """On the model thread: hand over every item held (the step's compute begins, or no step follows)."""
        for ahead in self._holding:
            ahead.release()
        self._holding.clear()

    def _gather(self) -> None:
        """Under the lock: give the sequences the last step served a moment to hand in their next token."""
        # A sequence that misses this step waits out all of it, so waiting a fraction of a step for
        # it costs the others less than splitting the batch; with one-token steps of a few
        # milliseconds (a GPU) the fixed floor is the wait.
        deadline = time.monotonic() + max(self.gather_s, GATHER_STEP_FRACTION * self._last_step_s)
        while True:
            pending = {w.member for w in self._pending}
            missing = [m for m in self._last_served if m not in pending and not m.away and m in self._members]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return
            self._cond.wait(left)

    def _plan(self) -> list[tuple[_Work, int]]:
        """Under the lock: the step's work and how many tokens of each, within the limits."""
        for work in [w for w in self._pending if w.member.cancelled.is_set() and not w.member.decoding]:
            work.error = StepCancelled()
            self._finish(work)
        budget: float = self.limits.max_num_batched_tokens
        seqs, idle = self.limits.max_num_seqs, self.limits.idle_batched_tokens
        decoding = sum(1 for m in self._members if m.decoding and not m.away)
        if idle is not None:
            # A burst runs at most two idle steps' worth before the decoders step again (a wave of
            # 32 prompts of 64 tokens and their templates is about 2,500).
            prefilling = [w.member for w in self._pending if not w.member.decoding]
            burst = self._bursts.members(prefilling, decoding, 2 * idle)
            if burst:
                return self._burst_plan(burst, idle)
            if not decoding:
                budget = max(budget, idle)  # no decode step to keep short: prompts go in whole
        # Beside decode rows a chunk's attention counts too, so the step stays near its usual cost.
        cost = self._chunk_cost if decoding and self.limits.attention_counted else None
        plan: list[tuple[_Work, int]] = []
        for work in sorted(self._pending, key=lambda w: (not w.member.decoding, w.member.order)):
            if len(plan) >= seqs or budget < 1:
                continue
            if cost is None or work.member.decoding:
                n = min(work.left, int(budget))
                budget -= n
            else:
                start = work.start + work.done
                # A step's first chunk takes a token at least, however far into its prompt.
                first = all(w.member.decoding for w, _ in plan)
                n = max(cost.tokens(start, work.left, budget), 1 if first else 0)
                if n == 0:
                    continue
                budget -= cost.rows(start, n)
            plan.append((work, n))
        return plan

    def _burst_plan(self, burst: set, idle: int) -> list[tuple[_Work, int]]:
        """Under the lock: a burst's step (`burst.Bursts`), its prompts first come first served, whole,
        up to `BURST_STEP_TOKENS` (a longer first one alone, up to the idle budget); no decode rows."""
        plan: list[tuple[_Work, int]] = []
        tokens = 0
        for work in sorted((w for w in self._pending if w.member in burst), key=lambda w: w.member.order):
            n = min(work.left, idle) if not plan else work.left
            if plan and (tokens + n > BURST_STEP_TOKENS or len(plan) >= self.limits.max_num_seqs):
                break
            plan.append((work, n))
            tokens += n
        self._bursts.ran(tokens)
        return plan

    def _room_for(self, plan: list[tuple[_Work, int]]) -> list[tuple[_Work, int]]:
        """Under the lock: the blocks every paged row of `plan` needs, preempting the newest
        member holding blocks while the pool has too few; the plan without the rows that lost
        theirs (or, for a prompt chunk, could not get them yet)."""
        ready: list[tuple[_Work, int]] = []
        for work, n in plan:
            cache = work.member.cache
            while not work.finished:
                try:
                    if isinstance(cache, PagedKVCache):
                        cache.make_room(work.start + work.done + n)
                    ready.append((work, n))
                    break
                except PoolExhausted as exc:
                    holders = [m for m in self._members if isinstance(m.cache, PagedKVCache) and m.cache.blocks]
                    victim = max(holders, key=lambda m: m.order, default=None)
                    if victim is None or victim.order < work.member.order:
                        if victim is None:  # no one holds a block to give back: it can never fit
                            work.error = exc
                            self._finish(work)
                        break  # it waits for room, as a request waits for admission
                    self._preempt(victim, f"the KV pool had no free block for {cache.owner}")
        return [(w, n) for w, n in ready if not w.finished]

    def _preempt(self, member: Member, reason: str) -> None:
        """Under the lock: take `member`'s blocks back; its work in the loop ends with `Preempted`."""
        freed = member.cache.release()
        preempted = Preempted(reason, freed.blocks, freed.nbytes)
        member.decoding = False
        member.preemptions += 1
        self.preemptions += 1
        self._last_served.discard(member)
        pending = [w for w in self._pending if w.member is member]
        for work in pending:
            work.error = preempted
            self._finish(work)
        if not pending:
            member.preempted = preempted

    def _step_bytes(self, plan: list[tuple[_Work, int]]) -> StepBytes:
        """A shared step's read: the weights once, and the K/V every decode row attended over."""
        kv = positions = 0
        for work, _ in plan:
            member = work.member
            if member.decoding:
                tokens = member.cache.tokens
                kv, positions = kv + member.position_bytes * tokens, positions + tokens
        return StepBytes(self.weight_bytes, kv, positions)

    @staticmethod
    def _summaries(plan: list[tuple[_Work, int]], logits: list[torch.Tensor | None]) -> dict[int, LogitSummary]:
        """Outside the lock: the logit summaries the step's finishing rows asked for, by row,
        each top-candidate count's rows summarized together (after the step's own time is taken:
        it is the traces' cost, not the forward's). A row alone shares no pass, so its consumer
        computes its own, as it would without a loop (measured no faster here, 0.6 ms either way)."""
        asked: dict[int, list[int]] = {}
        for i, (work, n) in enumerate(plan):
            if work.summarize is not None and work.done + n == len(work.ids) and logits[i] is not None:
                asked.setdefault(work.summarize, []).append(i)
        out: dict[int, LogitSummary] = {}
        for k, rows in asked.items():
            if len(rows) < 2:
                continue
            for i, summary in zip(rows, summarize([logits[i] for i in rows], k), strict=True):  # type: ignore[misc]
                out[i] = summary
        return out

    def _finish(self, work: _Work, pending: bool = True) -> None:
        if pending:
            self._pending.remove(work)
        work.finished = True
        if work.ready is not None:
            work.ready.set()
        if work.ahead is not None and work.error is not None:  # the run ahead ends with it
            self._hold(work.ahead, work.error)
            if work.member.ahead is work.ahead:
                work.member.ahead = None

    def _step(self, plan: list[tuple[_Work, int]], waiting: int, members: list[Member]) -> None:
        """Run one step outside the lock, then hand each work its part of the result."""
        rows = [Row(w.ids[w.done : w.done + n], w.start + w.done, w.member.cache, w.done + n == len(w.ids),
                    w.observer if w.done + n == len(w.ids) else None)
                for w, n in plan]
        start = time.perf_counter()
        error: BaseException | None = None
        logits: list[torch.Tensor | None] = []
        try:
            logits = self.runner.forward_rows(rows, computing=self._release)
            synchronize(self.runner.device)
        except Exception as exc:  # the step failed: every request in it fails with the same error
            error = exc
        step_ms = (time.perf_counter() - start) * 1000
        path = self.runner.last_path.name
        summaries = self._summaries(plan, logits) if error is None else {}
        chosen = self._choose(plan, logits, summaries) if error is None else {}
        self._last_step_s = step_ms / 1000 if len(plan) > 1 else 0.0  # a lone sequence has no one to wait for
        decode = sum(n for w, n in plan if w.member.decoding)
        read = self._step_bytes(plan) if len(plan) > 1 and error is None else None
        solo = statistics.median(self._solo_ms) if self._solo_ms else None
        if len(plan) == 1 and decode == 1 and error is None:
            self._solo_ms.append(step_ms)
        self.steps_run += 1
        with self._cond:
            handed_in = time.perf_counter()
            for i, (work, n) in enumerate(plan):
                member = work.member
                facts = BatchStep(
                    step=self.steps_run,
                    sequences=len(plan),
                    decode_tokens=decode,
                    prefill_tokens=sum(k for _, k in plan) - decode,
                    waiting=waiting,
                    step_ms=step_ms,
                    solo_step_ms=solo,
                    pool=self.pool(member, members),
                    bytes_read=read,
                    path=path,
                )
                member.steps.append(facts)
                member.last_step = facts
                if not member.decoding:
                    work.chunks.append(PrefillChunk(work.start + work.done, n, facts))
                    member.prefill_chunks += 1
                work.done += n
                if error is not None:
                    work.error = error
                    self._finish(work)
                elif work.done == len(work.ids):
                    work.logits = logits[i]
                    work.summary = summaries.get(i)
                    member.decoding = True
                    self._finish(work)
                    if work.ahead is not None and member.ahead is work.ahead:
                        self._go_on(work, chosen.get(i), facts, handed_in)
            # The sequences the next step waits a moment for (`_gather`): a run ahead has handed its
            # next token in already, or has ended.
            self._last_served = {w.member for w, _ in plan if w.ahead is None}
            self._cond.notify_all()

    @staticmethod
    def _choose(
        plan: list[tuple[_Work, int]], logits: list[torch.Tensor | None], summaries: dict[int, LogitSummary]
    ) -> dict[int, Chosen | Exception]:
        """Outside the lock: the next token of every row that runs ahead and finished its work in
        this step, by its chooser (a failure is that request's alone)."""
        due: list[tuple[int, _Work, Ahead, torch.Tensor]] = []
        for i, (work, n) in enumerate(plan):
            ahead, row = work.ahead, logits[i]
            if ahead is None or work.done + n != len(work.ids) or work.member.ahead is not ahead or row is None:
                continue
            due.append((i, work, ahead, row))
        prepare_choices([ahead.chooser for _, _, ahead, _ in due])  # every constrained row's mask, at once
        out: dict[int, Chosen | Exception] = {}
        for i, work, ahead, row in due:
            try:
                out[i] = ahead.chooser.choose(row, summaries.get(i), work.start + len(work.ids) - 1)
            except Exception as exc:  # e.g. logits with no finite maximum
                out[i] = exc
        return out

    def _go_on(self, work: _Work, chosen: Chosen | Exception | None, facts: BatchStep, handed_in: float) -> None:
        """Under the lock: post what the step gave a run ahead, and hand its next token in at once,
        unless the token ends the request or it was cancelled (None: nothing was chosen, it stops)."""
        member, ahead = work.member, work.ahead
        assert ahead is not None and work.logits is not None
        if chosen is None or isinstance(chosen, Exception):
            self._hold(ahead, chosen)
            member.ahead = None
            return
        kv = tuple(member.cache.lengths)
        self._hold(ahead, Decoded(work.ids, work.start, work.logits, chosen, facts, kv, work.handed_in))
        if chosen.last or member.cancelled.is_set():
            self._hold(ahead, None)
            member.ahead = None
            return
        at = work.start + len(work.ids)
        following = _Work(member, (chosen.token,), at, summarize=work.summarize, ahead=ahead, handed_in=handed_in)
        self._pending.append(following)

