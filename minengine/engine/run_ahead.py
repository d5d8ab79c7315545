"""Decode that no consumer steers: the step loop chooses each next token itself and goes on.

A session whose consumer may hold a step (the explorer: pause, force a token, change the
sampler) samples every token on its consumer's thread and hands it back to the step loop, so
the next step waits for it. A server's requests are never steered between steps, and that round
trip costs them: each of 8 requests' threads in turn woke, sampled, streamed and handed its token
back under the GIL between two shared steps, one after another, while the next step waited
(docs/engine.md, "Many requests, one step: continuous batching", has the figures). An unsteered
session (`Engine.start(..., steered=False)`) instead gives the loop a `TokenChooser`: right after
each of its steps the loop chooses the next token on the model thread (the logits still in its
caches), feeds it back at the next position at once, and posts a `Decoded` to the session's
`Ahead`. The consumer streams the tokens as they come, while the next step runs; this is how
vLLM's engine core runs every request, with sampling in the step and detokenizing apart from it.

The chooser applies the request's own rules (its `LogitStages`: grammar, min_tokens' mask, bias
and penalties, then its sampler, seed and sampler order; the tokens and the length that end it),
so the loop feeds back only a token that does not end the request. Right after a step's forward,
before any of its rows is chosen, the loop computes the grammar mask of every constrained row
(`prepare_choices`), on the model thread while no parallel region runs. A stop string is only seen by
the consumer, after detokenizing: the loop may then have run one step too many for it, whose
token is never streamed (vLLM's async scheduling does the same).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from minengine.sampling.step_trace import StepTrace
from minengine.sampling.trace import greedy_candidates

if TYPE_CHECKING:
    from minengine.engine.batch_facts import BatchStep
    from minengine.engine.request import GenerationRequest
    from minengine.sampling.grammar import GrammarMatcher
    from minengine.sampling.logit_stages import LogitStages
    from minengine.sampling.logit_summary import LogitSummary


@dataclass(frozen=True)
class Chosen:
    """The token the loop chose from one step's logits, and whether the request ends with it."""

    token: int
    trace: StepTrace | None  # when the request asked for one
    last: bool  # it ends the request (a stop token, max_tokens, the context): nothing is fed after it


class TokenChooser(Protocol):
    """What an unsteered session gives the loop to choose its tokens with (on the model thread)."""

    summarize: int | None  # top candidates the step summarizes its logits to (`logit_summary`); None: none

    @property
    def grammar(self) -> GrammarMatcher | None:
        """The grammar whose next mask the step computes before choosing, with every other row's
        (`prepare_choices`); None: the row has none."""
        ...

    def choose(self, logits: torch.Tensor, summary: LogitSummary | None, fed_at: int) -> Chosen:
        """The next token after logits produced by the token fed at position `fed_at`."""
        ...


@dataclass(frozen=True)
class Decoded:
    """One step the loop ran ahead for a request: what it fed, the logits, and the token chosen."""

    fed: tuple[int, ...]  # the tokens the step (or, for a recompute, its steps) fed
    start: int  # the position of the first of them
    logits: torch.Tensor
    chosen: Chosen
    step: BatchStep  # the step that produced the logits, as this request saw it
    kv_lengths: tuple[int, ...]  # the cache's per-layer positions right after that step
    handed_in: float  # perf_counter when the work was handed in: the step behind the token began then


class Ahead:
    """One run ahead: the loop posts each `Decoded` here, an exception that ended it, or None
    when it stopped feeding (cancelled, or after the request's last token).

    The loop holds what it posts until the next step's compute begins (`hold`, `release`): a
    consumer woken at once would run its Python beside the next step's, and the two take the
    GIL from each other (the model thread's own Python between two 8-row steps took over twice as
    long with 8 consumers awake: docs/engine.md, "Many requests, one step: continuous batching");
    woken then, its thread runs beside the step's C kernels.
    """

    def __init__(self, chooser: TokenChooser) -> None:
        self.chooser = chooser
        self._outbox: queue.SimpleQueue[Decoded | BaseException | None] = queue.SimpleQueue()
        self._held: list[Decoded | BaseException | None] = []  # posted, not yet handed over (model thread only)

    def post(self, item: Decoded | BaseException | None) -> None:
        """Hand the consumer the next item now."""
        self._outbox.put(item)

    def hold(self, item: Decoded | BaseException | None) -> None:
        """Post `item` at the next `release` (from the model thread)."""
        self._held.append(item)

    def release(self) -> None:
        """Hand over every item held, in order (from the model thread)."""
        for item in self._held:
            self._outbox.put(item)
        self._held.clear()

    @property
    def holds(self) -> bool:
        """Whether items are held for the next `release`."""
        return bool(self._held)

    def ready(self) -> bool:
        """Whether an item waits, handed over or held."""
        return bool(self._held) or not self._outbox.empty()

    def take(self) -> Decoded | None:
        """The next item, waited for; an exception the loop posted is raised here."""
        item = self._outbox.get()
        if isinstance(item, BaseException):
            raise item
        return item


def prepare_choices(choosers: list[TokenChooser]) -> None:
    """Before a step's rows are chosen, right after its forward, on the model thread: every
    constrained row's mask for this step, one after another (`GrammarMatcher.fill`), instead of
    a worker thread's beside the forward. llguidance's batch fill (`LLExecutor`) was no faster on
    two cores and would hand the rows to threads of its own. A fill that fails is left for that
    row's own choice to meet again, so it fails that request alone."""
    for chooser in choosers:
        grammar = chooser.grammar
        if grammar is not None:
            try:
                grammar.fill()
            except Exception:  # the row's `choose` computes it again and fails that request only
                continue


def stops_at(request: GenerationRequest, eos_ids: frozenset[int] | set[int], token: int, count: int) -> bool:
    """Whether `token`, the request's `count`-th, ends it as a stop token: end of sequence (unless
    ignore_eos) or one of its stop_token_ids, once min_tokens are out (vLLM's rule)."""
    return ((token in eos_ids and not request.ignore_eos) or token in request.stop_token_ids) and (
        count >= request.min_tokens
    )


def length_reached(request: GenerationRequest, count: int, next_position: int, context: int) -> bool:
    """Whether the request ends after its `count`-th token by length: max_tokens are out, or the
    token would be fed at `next_position` with no room after it in the model's context."""
    return count >= request.max_tokens or next_position + 1 >= context


class RequestChooser:
    """A request's `TokenChooser`: its stages and sampler (`LogitStages`, shared with its session, so
    the tokens the session chose before are counted) and its ending rules."""

    def __init__(
        self,
        request: GenerationRequest,
        stages: LogitStages,
        eos_ids: frozenset[int] | set[int],
        context: int,
    ) -> None:
        self.request, self.stages, self.eos_ids = request, stages, eos_ids
        self.context = context
        if stages.grammar is not None:  # the loop computes its masks between steps (`prepare_choices`)
            stages.grammar.fill_in_step()
        # A step's summary is of the model's own row; a grammar's row is another, so none is made for it.
        summarized = request.trace and stages.sampler.params.greedy and stages.grammar is None
        self.summarize = greedy_candidates(request.top_n) if summarized else None

    @property
    def grammar(self) -> GrammarMatcher | None:
        """The request's grammar (its stages'), if it has one."""
        return self.stages.grammar

    def choose(self, logits: torch.Tensor, summary: LogitSummary | None, fed_at: int) -> Chosen:
        """Pick the next token as the session would (its trace too, when asked), and say whether it ends."""
        req = self.request
        token, trace = self.stages.pick(logits, traced=req.trace, top_n=req.top_n, summary=summary)
        count = self.stages.count
        ends = stops_at(req, self.eos_ids, token, count)
        return Chosen(token, trace, ends or length_reached(req, count, fed_at + 1, self.context))
