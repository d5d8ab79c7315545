"""One request's life in the engine, as one function per stage of the seeds' lifecycle.

`RequestSession._run` chains the stages. Each is a generator that yields its events and
returns the record the next stage starts from:

    _gateway    mark the arrival, validate               -> gateway stage
    _template   render the chat template once            -> template stage; a `PromptText`
    _tokenize   encode, count tokens per prompt part     -> tokenize stage, PromptEvent; the ids
    _admit      size the KV cache, look the prompt up in the prefix cache, wait for the scheduler
                                                         -> admit stage, AdmitEvent; `AdmittedKV`, and the hit
    _prefix_cache  make the cache, copy the hit in       -> prefix_cache stage, PrefixCacheEvent; `Cached`
    _prefill    the rest of the prompt, in chunks within the step budget -> prefill stage, PrefillEvent; the logits
    _decode     sample, stream, feed back, until a stop  -> StepReady/TokenEvent pairs; finish reason
    _complete   close the timeline, build the result     -> decode and complete stages, DoneEvent

What decode produces (tokens, text, visible-token times, KV peak) lives in one `DecodeState`,
made before the first stage so that a request failing anywhere still reports what it had. A
failure in any stage ends the request as `error`. A stage that takes something to give back (the
admission, the cache) registers its return on the run's exit stack the moment it holds it, so it
is given back whatever happens, in reverse, before completion is reported: with the prefix
cache on, the cache's full blocks are kept for later requests, then the cache and the admission
are released. The session reaches its engine through `EngineHandle`, and the model only through
`_new_cache` and `_forward`, which hands its work to its place in the engine's step loop
(`step_loop.Member`), where it runs in steps shared with the other running requests.

A RequestSession is an iterator of events. The consumer drives it: every pull runs the engine
up to the next event, so a consumer that stops pulling at a `StepReady` has paused decode
with the next token's logits computed and waiting. While paused it may preview the step with
other sampling parameters, force the next token, change the parameters for the steps that
follow, turn the request's grammar off or on again (`set_grammar`), or compute what the
waiting step did inside (`inspect_step`); `inspect` asks for that to be captured on every step
from the next one on (`minengine.inspect`). `cancel()` may be called from any thread; decode
stops before the next model step.
Those controls, and what the run reports (`pending_logits`, `result`, `failure`), are all the
state a session keeps on itself.

A consumer that holds a step (the explorer, for a person) says so with `hold()`; the time until
it pulls again is counted as held, not as the engine's. Each TokenEvent carries the held time
since the previous token, and the result keeps the metrics twice: on the wall clock, as a client
would have seen them, and on the engine's own clock, with the held time taken out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from minengine.device import synchronize
from minengine.engine.batch_facts import BatchStep, BatchSummary, PreemptEvent, PrefillChunk
from minengine.engine.events import (
    AdmitEvent,
    DoneEvent,
    Event,
    PrefillEvent,
    PrefixCacheEvent,
    PromptEvent,
    RequestResult,
    StageEvent,
    StepReady,
    TokenEvent,
    Usage,
)
from minengine.engine.metrics import request_metrics, without_held
from minengine.engine.request import GenerationRequest, validate
from minengine.engine.roofline import StepBytes, step_bytes
from minengine.engine.run_ahead import (
    Ahead,
    Chosen,
    Decoded,
    RequestChooser,
    length_reached,
    stops_at,
)
from minengine.engine.scheduler import Admission, Scheduler
from minengine.engine.step_loop import Member, Preempted, StepCancelled, StepLoop
from minengine.engine.timeline import STAGE_SPANS, Timeline
from minengine.errors import EngineText, QueueCancelledError, ReqscopeError, RequestError, Setting
from minengine.inspect.ask import FULL_VIEW, InspectAsk
from minengine.inspect.capture import StepCapture
from minengine.inspect.records import StepInspection
from minengine.kv.arithmetic import blocks_for, kv_bytes_in_blocks, stored_kv_heads
from minengine.kv.block_pool import BlockFormat, BlockPool
from minengine.kv.cache import KVCache
from minengine.kv.paged_cache import PagedKVCache
from minengine.kv.prefix_cache import KVIdentity, PrefixCache, PrefixHit
from minengine.kv.usage import KVUsage
from minengine.sampling.chain import filter_logits
from minengine.sampling.grammar import Grammar, GrammarMatcher, compile_grammar, needs_grammar
from minengine.sampling.logit_stages import LogitStages
from minengine.sampling.params import SamplingParams
from minengine.sampling.sampler import Sampler
from minengine.sampling.step_trace import StepTrace
from minengine.sampling.trace import explain, greedy_candidates
from minengine.text.detokenizer import IncrementalDetokenizer
from minengine.text.prompt_parts import count_parts, token_parts
from minengine.text.stop import StopMatcher
from minengine.text.tool_prompt import ChatInput, tool_spans
from minengine.threads import OneThread, model_thread

if TYPE_CHECKING:
    from minengine.config import ModelConfig
    from minengine.steps.model_runner import ModelRunner
    from minengine.text.tokenizer import ModelTokenizer

_STAGE_BY_END = {end: (stage, start) for stage, start, end in STAGE_SPANS}
_KV_STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class KVSizing:
    """The KV cache a request is admitted for."""

    storage: torch.dtype  # how K/V are stored
    tokens: int  # prompt + max_tokens: every position the request may cache
    reserved_bytes: int  # block-rounded worst case, what the scheduler reserves


def kv_sizing(cfg: ModelConfig, model_dtype: torch.dtype, request: GenerationRequest, prompt_tokens: int) -> KVSizing:
    """Size the KV cache `request` needs after a `prompt_tokens`-token prompt on a model of `cfg`."""
    storage = model_dtype if request.kv_dtype == "auto" else _KV_STORAGE[request.kv_dtype]
    heads = stored_kv_heads(request.kv_layout, cfg.num_attention_heads, cfg.num_key_value_heads)
    tokens = prompt_tokens + request.max_tokens
    reserved = kv_bytes_in_blocks(
        cfg.num_hidden_layers, heads, cfg.head_dim, storage.itemsize, tokens, request.block_size
    )
    return KVSizing(storage, tokens, reserved)


@dataclass
class DecodeState:
    """What a request has produced so far, and what its decode loop carries from step to step."""

    detok: IncrementalDetokenizer
    stopper: StopMatcher
    generated: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    first_visible_index: int | None = None  # the first token that made text visible
    last_visible: tuple[int, float] | None = None  # (index, t_ms) of the latest such token
    peak: KVUsage | None = None  # the latest cache snapshot; the cache only grows
    pos: int = 0  # the position the next token fed to the model takes
    fed: list[int] = field(default_factory=list)  # ids of positions [0, pos): what a preempted request recomputes
    step_start: float = 0.0  # perf_counter when the model step behind the waiting logits began
    step_held_ns: int = 0  # the session's held time when that step began: a hold within it is not its time
    weight_bytes: int = 0  # weight bytes a decode step reads (the model's, for this request's steps)
    previous_t: float | None = None  # t_ms of the previous token, for the next one's ITL
    batch: BatchStep | None = None  # the shared step behind the waiting logits (None: prefill made them)
    kv_lengths: tuple[int, ...] | None = None  # the cache's positions right after that step, when it ran ahead
    held_totals: list[float] = field(default_factory=list)  # ms held in all, as of each generated token

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self.text_parts)


class EngineHandle(Protocol):
    """What a session uses of the engine that runs it (`Engine` is one)."""

    tokenizer: ModelTokenizer
    cfg: ModelConfig
    dtype: torch.dtype  # the model's
    device: torch.device
    runner: ModelRunner  # makes the request's cache
    scheduler: Scheduler
    pool: BlockPool  # the KV blocks of every request and of the prefix cache
    steps: StepLoop  # runs the request's forwards, in steps shared with the other running requests
    prefix_cache: PrefixCache | None  # read at each admission: the engine may turn it off between requests

    def kv_identity(self, layout: str, storage_dtype: torch.dtype, block_size: int) -> KVIdentity:
        """What, besides the tokens, decides the K/V of a request's cache on this engine."""
        ...


@dataclass(frozen=True)
class PromptText:
    """The template stage's output: the text the model reads, and where its generation prompt starts."""

    text: str
    generation_prompt_start: int | None  # len(text) when the template adds none; None for a raw prompt
    chat: ChatInput | None = None  # what the template was given (None for a raw prompt)


@dataclass(frozen=True)
class PrefixPlan:
    """Where a request's blocks are looked up and kept: the prefix cache, under the cache's identity."""

    pool: PrefixCache
    identity: KVIdentity


@dataclass(frozen=True)
class AdmittedKV:
    """The admit stage's output: the KV the request was admitted for, and its reservation."""

    kv: KVSizing
    admission: Admission
    prefix: PrefixPlan | None  # None with the prefix cache off


@dataclass(frozen=True)
class Cached:
    """The prefix cache stage's output: the request's KV cache, the hit copied in, the stage's event,
    and the request's place in the step loop."""

    cache: KVCache | PagedKVCache
    event: PrefixCacheEvent
    member: Member


@dataclass(frozen=True)
class Reached:
    """What the stages before decode had handed over when the request ended, for its result."""

    prompt_tokens: int = 0
    queue_ms: float = 0.0  # the admission's wait (or, cancelled while queued, the wait until then)
    prefix: PrefixCacheEvent | None = None
    member: Member | None = None  # its place in the step loop, once it had a cache


class RequestSession:
    """Iterate to run the request; control it between events."""

    def __init__(
        self,
        engine: EngineHandle,
        request: GenerationRequest,
        timeline: Timeline | None = None,
        *,
        steered: bool = True,
    ):
        """`steered=False`: the consumer never steers the run between steps (no holding, forcing,
        changing the sampler or inspecting), so the engine samples each token in the step and goes
        on without waiting for the consumer (`minengine.engine.run_ahead`), as a server runs a request."""
        self.engine = engine
        self.request = request
        self.steered = steered
        self.timeline = timeline or Timeline()
        if self.timeline.time_of("client_send") is None:
            self.timeline.mark("client_send", "request created")
        self.cancelled = threading.Event()
        self.sampling: SamplingParams = request.sampling
        self.pending_logits: torch.Tensor | None = None
        self.result: RequestResult | None = None
        self.failure: ReqscopeError | None = None  # why the request failed, for callers that map errors
        self._forced: int | None = None
        self._sampler: Sampler | None = None  # decode's, made when decode starts; `update_sampling` reaches it
        self._held_ns = 0  # time the consumer held the session suspended (see `hold`)
        self._holding = False  # the consumer holds the suspension in progress
        self._member: Member | None = None  # its place in the step loop, from the prefix cache stage on
        self._capture = StepCapture(request.kv_layout, engine.tokenizer.piece)  # what `inspect` asks
        self._held_step: tuple[int, int] | None = None  # (token fed, its position) behind the waiting logits
        self._ahead: Ahead | None = None  # the run ahead the step loop posts this request's tokens to (unsteered)
        self._chooser: RequestChooser | None = None
        self._grammar: Grammar | None = None  # the request's, compiled at the gateway
        self._grammar_wanted = True  # whether it masks the steps: `set_grammar` turns it off and on
        self._stages: LogitStages | None = None  # grammar, min_tokens, bias, penalties: made when decode starts

    # -- control, from the consumer (or, for cancel, any thread) -----------------------------

    def cancel(self) -> None:
        """Stop the request before its next model step."""
        self.cancelled.set()

    def hold(self) -> None:
        """Count the wait until the next pull as held by the consumer, not as the engine's time.

        Call it from the consumer's side while the session is suspended at an event (a step
        held for a person: paused, stepped, a settings form open). The whole suspension, from
        the event's yield to the next pull, is taken out of the engine's own timings; a consumer
        that never calls it (headless, a server) leaves the engine's figures equal to the wall clock's.
        """
        self._holding = True
        if self._member is not None:
            self._member.away = True  # the step loop goes on without it until it hands in work again

    def _steering(self, what: str) -> None:
        if not self.steered:
            raise RequestError(f"this request runs unsteered (the engine samples each token as it steps), so it "
                               f"cannot {what}; start it with steered=True")

    def force_next(self, token_id: int) -> None:
        """Make the next step commit `token_id` instead of sampling."""
        self._steering("force a token")
        if not 0 <= token_id < self.engine.cfg.vocab_size:
            raise RequestError(f"token id {token_id} is outside the vocabulary (0..{self.engine.cfg.vocab_size - 1})")
        if self._stages is not None:  # refused before it is committed: the grammar cannot take it back
            self._stages.refuse_forbidden(token_id)
        self._forced = token_id

    def update_sampling(self, params: SamplingParams) -> None:
        """Use `params` from the next step on (validated first)."""
        self._steering("change its sampling parameters")
        params.validate()
        self.sampling = params
        if self._sampler is not None:
            self._sampler.update(params)

    @property
    def grammar_active(self) -> bool:
        """Whether the request's grammar masks its next step (False for a request without one)."""
        if not needs_grammar(self.request):
            return False
        stages = self._stages
        return self._grammar_wanted if stages is None else stages.grammar is not None

    def set_grammar(self, on: bool) -> None:
        """Turn the request's grammar (its output schema, or the tool call it must make) off or on
        from the next step on; while held at a step, that step's preview and draw take it at once.

        Off drops the matcher: the next steps are free. On compiles the grammar anew and feeds it
        the tokens generated so far, in order; RequestError (the grammar staying off) when they, or
        a token forced for the next step, do not fit it. Like `force_next` and `update_sampling`,
        call it while the session is suspended at an event, from the consumer's side: the new
        matcher is built apart and swapped in whole, so a step being previewed meanwhile sees
        either grammar, never half of one.
        """
        self._steering("turn its grammar off or on")
        if not needs_grammar(self.request):
            raise RequestError(
                "this request has no grammar to turn off or on: it has no output schema (response_format, "
                "structured_outputs) and no tool_choice that forces a call"
            )
        stages = self._stages
        if stages is not None and self._grammar is not None:
            if not on:
                stages.grammar_off()
            elif stages.grammar is None:
                stages.grammar_on(GrammarMatcher(self._grammar, self.engine.tokenizer), self._forced)
        self._grammar_wanted = on  # before decode, the stages start as this says

    def inspect(self, ask: InspectAsk) -> None:
        """Capture what `ask` asks inside each step from the next one on (a visible panel, a flag);
        `inspect.ask.NOTHING` stops it, and decode takes its uncaptured path again. Each captured
        step's records come on its TokenEvent (`inspection`)."""
        if ask.anything:
            self._steering("be inspected inside its steps")
        self._capture.ask = ask

    def inspect_step(self, ask: InspectAsk = FULL_VIEW, token: int | None = None) -> StepInspection | None:
        """The waiting step's views now, computed as `ask` asks (by default all of them, the lens
        over the whole vocabulary), tracking `token` in the lens (by default the one `preview`
        would show chosen); None when no step waits. The step is run again over the cache it
        wrote, writing nothing: the waiting logits and every later step stay as they were."""
        if self.pending_logits is None or self._held_step is None or self._member is None:
            return None
        if token is None:
            filtered, _ = filter_logits(self._adjusted(self.sampling), self.sampling)
            token = self._forced if self._forced is not None else int(filtered.argmax())
        fed, position = self._held_step
        model, cache = self.engine.runner.model, self._member.cache
        # A forward and the lens: on the model thread, as every step (`threads.model_thread`).
        return model_thread().call(lambda: self._capture.on_demand(model, cache, fed, position, token, ask))

    def preview(self, params: SamplingParams | None = None, top_n: int | None = None) -> StepTrace | None:
        """Explain the waiting step under `params` without sampling or running the model.

        The chosen token shown is the forced one, else the most likely survivor of the chain.
        """
        if self.pending_logits is None:
            return None
        params = params or self.sampling
        top_n = top_n or self.request.top_n
        logits, adjustments = self.pending_logits, None
        if self._stages is not None:  # what the stages before the filters would do to it, unchanged
            logits, adjustments = self._stages.adjust_traced(logits, params, top_n)
        filtered, _ = filter_logits(logits, params)
        chosen = self._forced if self._forced is not None else int(filtered.argmax())
        trace = explain(
            logits, params, chosen, self.engine.tokenizer.piece, top_n=top_n, forced=self._forced is not None
        )
        return trace if adjustments is None else replace(trace, adjustments=adjustments)

    def _adjusted(self, params: SamplingParams) -> torch.Tensor:
        """The waiting logits as the filters would see them under `params` (the stages before them applied)."""
        assert self.pending_logits is not None
        if self._stages is None:
            return self.pending_logits
        return self._stages.adjust(self.pending_logits, params)

    # -- the lifecycle -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        return self._held_apart(self._run())

    def _held_apart(self, events: Generator[Event, None, None]) -> Iterator[Event]:
        """`events`, timing every suspension the consumer held (see `hold`) into `_held_ns`."""
        try:
            for event in events:
                suspended = time.perf_counter_ns()
                yield event
                if self._holding:
                    self._holding = False
                    self._held_ns += time.perf_counter_ns() - suspended
        finally:
            events.close()  # a consumer that stops early still releases the cache and the admission

    def _run(self) -> Iterator[Event]:
        """The stages in order; a failure in any of them ends the request as an error."""
        state = DecodeState(IncrementalDetokenizer(self.engine.tokenizer.tok), StopMatcher(self.request.stop))
        finish, error = "error", None
        reached = Reached()
        releases = ExitStack()  # what the stages hold, given back in reverse however the request ends
        try:
            yield from self._gateway()
            prompt = yield from self._template()
            ids = yield from self._tokenize(prompt)
            reached = replace(reached, prompt_tokens=len(ids))
            admitted, hit = yield from self._admit(ids, releases)
            reached = replace(reached, queue_ms=admitted.admission.queue_ms)
            cached = yield from self._prefix_cache(ids, admitted, hit, state, releases)
            hit = None  # copied in: the kept blocks it holds must not outlive their eviction
            reached = replace(reached, prefix=cached.event, member=cached.member)
            logits = yield from self._prefill(ids, cached, state)
            finish = yield from self._decode(logits, cached.cache, state)
        except StepCancelled:  # cancelled between two chunks of its prompt
            finish = "cancelled"
        except QueueCancelledError as exc:  # cancelled before it ran: not a failure
            finish, self.failure = "cancelled", exc
            reached = replace(reached, queue_ms=exc.waited_ms)
        except ReqscopeError as exc:
            finish, error = "error", exc.message
            self.failure = exc
        except torch.OutOfMemoryError as exc:
            first_line = str(exc).splitlines()[0]
            finish, error = "error", EngineText(f"out of memory: {first_line}; lower ", Setting.MAX_TOKENS)
        finally:
            self.pending_logits = None
            releases.close()
        yield from self._complete(finish, error, state, reached)

    def _gateway(self) -> Iterator[Event]:
        """Gateway: note the arrival, unless a server already did, and validate the request."""
        if self.timeline.time_of("server_arrival") is None:  # a server marks it itself, when the HTTP request lands
            self.timeline.mark("server_arrival", self.request.request_id)
        validate(self.request, vocab_size=self.engine.cfg.vocab_size)
        # Compiled here, before the request is queued: a grammar that cannot compile fails at once.
        self._grammar = compile_grammar(self.request, self.engine.tokenizer)
        yield self._stage("validated", self.request.request_id)

    def _template(self) -> Generator[Event, None, PromptText]:
        """Chat template: render the messages, once; return the prompt text (a raw prompt as it is)."""
        req, tok = self.request, self.engine.tokenizer
        if req.raw_prompt is not None:
            yield self._stage("templated", "raw prompt, no chat template")
            return PromptText(req.raw_prompt, None)
        messages, tools, generic = list(req.messages), req.tools, req.generic_tools
        chat = tok.chat_input(messages, tools, generic)  # refuses tools the template cannot take, before rendering
        rendered = tok.render(messages, tools=tools, generic_tools=generic)
        # Where the generation prompt starts is known from the template itself for the usual
        # one (a fixed text appended at the end); only other templates render a second time.
        start = tok.generation_prompt_start(messages, rendered, tools=tools, generic_tools=generic)
        prompt = PromptText(rendered, start, chat)
        tools_note = f", tools {chat.rendering}" if tools else ""
        yield self._stage("templated", f"{len(rendered)} chars{tools_note}")
        return prompt

    def _tokenize(self, prompt: PromptText) -> Generator[Event, None, tuple[int, ...]]:
        """Tokenization: encode the prompt text, count its tokens per part; return the ids."""
        pieces = self.engine.tokenizer.encode_pieces(prompt.text)
        ids = tuple(p.token_id for p in pieces)
        yield self._stage("tokenized", f"{len(ids)} tokens")
        if prompt.generation_prompt_start is None or prompt.chat is None:  # a raw prompt is all the user's
            names = ("user",) * len(pieces)
        else:
            chat, start = prompt.chat, prompt.generation_prompt_start
            spans = tool_spans(prompt.text, chat, start)
            names = token_parts(prompt.text, start, chat.messages, pieces, chat.parts, spans)
        yield PromptEvent(prompt.text, tuple(pieces), count_parts(names), names)
        return ids

    def _admit(
        self, ids: tuple[int, ...], releases: ExitStack
    ) -> Generator[Event, None, tuple[AdmittedKV, PrefixHit | None]]:
        """Admission: size the worst-case KV, wait for the scheduler to admit it once its prompt's
        blocks (beyond what the prefix cache holds of it) fit in the pool, then look the prompt
        up in the prefix cache; return what was admitted, and the prefix cache's hit.

        A request waiting in the queue holds nothing in the pool: holding its hit's blocks there,
        a dozen queued requests once pinned 44 of a 48-block pool, so neither the head of the
        queue nor any running request could ever get a block (the load suite's small pool hung in
        1 run of 15). The lookup comes right after admission, before the request allocates
        anything, so it still makes the hit most recently used and the kept blocks the request's
        own allocations evict are others; the hit goes on apart from the record and holds its
        blocks until the next stage has taken them.
        """
        eng, req = self.engine, self.request
        prompt_tokens = len(ids)
        kv = kv_sizing(eng.cfg, eng.dtype, req, prompt_tokens)
        prefix = None
        if eng.prefix_cache is not None:
            prefix = PrefixPlan(eng.prefix_cache, eng.kv_identity(req.kv_layout, kv.storage, req.block_size))
        cfg, heads = eng.cfg, stored_kv_heads(req.kv_layout, eng.cfg.num_attention_heads, eng.cfg.num_key_value_heads)
        blocks = BlockFormat(cfg.num_hidden_layers, heads, cfg.head_dim, req.block_size, kv.storage)
        prompt_blocks = blocks_for(prompt_tokens, req.block_size)
        hashes = prefix.pool.prompt_hashes(ids, prefix.identity) if prefix is not None else []

        def fits() -> bool:  # its prompt's blocks, less the hit's blocks running requests hold already
            shared = prefix.pool.shared_prefix_blocks(hashes) if prefix is not None else 0
            return eng.pool.can_allocate(blocks, prompt_blocks - shared)

        admission = eng.scheduler.admit(
            req.request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=req.max_tokens,
            context_limit=eng.cfg.max_position_embeddings,
            kv_bytes=kv.reserved_bytes,  # what it could grow to: refused if even the whole budget is less
            cancelled=self.cancelled,
            fits=fits,  # it waits for its prompt's blocks
        )
        releases.callback(eng.scheduler.release, admission)
        hit = None
        if prefix is not None:
            hit = prefix.pool.lookup(ids, prefix.identity, holder=f"{req.request_id} (prefix hit)")
            releases.callback(hit.release)
        yield self._stage("scheduler_admit", f"queue {admission.queue_ms:.1f} ms")
        yield AdmitEvent(
            prompt_tokens,
            req.max_tokens,
            eng.cfg.max_position_embeddings,
            kv.reserved_bytes,
            eng.scheduler.kv_budget_bytes,
            admission.queue_ms,
        )
        return AdmittedKV(kv, admission, prefix), hit

    def _prefix_cache(
        self, ids: tuple[int, ...], admitted: AdmittedKV, hit: PrefixHit | None, state: DecodeState, releases: ExitStack
    ) -> Generator[Event, None, Cached]:
        """Prefix cache: make the cache and copy the prompt's cached prefix into it.

        A paged cache shares the hit's blocks (no copy); the static decoder's arena copies them
        in. Copying is far cheaper than computing: a few milliseconds for the blocks of a prompt
        whose prefill takes a second (docs/engine.md, "Prefix caching", has the figures). The
        lookup itself ran at admission (`_admit`).
        """
        self.timeline.mark("prefix_cache_start")
        cache = self._new_cache(admitted.kv)
        releases.callback(cache.release)
        if admitted.prefix is not None:  # registered after the release: runs before it
            releases.callback(self._keep_blocks, cache, ids, state, admitted)
        member = self.engine.steps.join(cache, self.cancelled, admitted.admission.kv_bytes)
        releases.callback(member.leave)  # first of all: no step may touch the cache once it is given back
        self._member = member
        copy_ms = 0.0
        if hit is not None and hit.blocks:
            start = time.perf_counter()
            if isinstance(cache, PagedKVCache):
                cache.attach_prefix(list(hit.block_ids))
            else:
                cache.write_prefix(hit.span())
            hit.release()  # the cache holds the blocks (or their copy) now
            synchronize(self.engine.device)
            copy_ms = (time.perf_counter() - start) * 1000
        reused = 0 if hit is None else hit.tokens
        pool = None if admitted.prefix is None else admitted.prefix.pool
        if pool is None or hit is None:
            detail = "off"
        else:
            detail = f"{hit.blocks} of {hit.looked_up} blocks hit, {reused} of {len(ids)} prompt tokens reused"
        stage = self._stage("prefix_cache_end", detail)
        yield stage
        event = PrefixCacheEvent(
            enabled=pool is not None,
            prompt_tokens=len(ids),
            block_size=self.request.block_size,
            blocks_looked_up=0 if hit is None else hit.looked_up,
            blocks_hit=0 if hit is None else hit.blocks,
            reused_tokens=reused,
            lookup_ms=0.0 if hit is None else hit.lookup_ms,
            copy_ms=copy_ms,
            duration_ms=stage.duration_ms,
            kept_blocks=0 if pool is None else pool.kept_blocks,
            kept_bytes=0 if pool is None else pool.kept_bytes,
            note=EngineText("the engine runs without a prefix cache (", Setting.PREFIX_CACHE_OFF, ")")
            if pool is None
            else "",
        )
        yield event
        return Cached(cache, event, member)

    def _prefill(
        self, ids: tuple[int, ...], cached: Cached, state: DecodeState
    ) -> Generator[Event, None, torch.Tensor]:
        """Prefill: run the prompt after its reused prefix through the model; return the first logits."""
        reused = cached.event.reused_tokens
        detail = f"{len(ids) - reused} tokens" + (f" after {reused} reused" if reused else "")
        self.timeline.mark("prefill_start", detail)
        self._start_step(state)
        # The loop synchronizes after each step: prefill ends when the device has finished.
        state.fed = list(ids[:reused])
        logits, chunks = yield from self._forward_or_recompute(ids[reused:], reused, state)
        state.pos = len(ids)
        stage = self._stage("prefill_end")
        yield stage
        state.peak = cached.cache.usage()
        yield PrefillEvent(len(ids), stage.duration_ms, state.peak, reused_tokens=reused, chunks=tuple(chunks))
        return logits

    def _decode(
        self, logits: torch.Tensor, cache: KVCache | PagedKVCache, state: DecodeState
    ) -> Generator[Event, None, str]:
        """Decode: pause at each step, sample, stream, feed the token back; return the finish reason."""
        # The sampler starts from the parameters in force now: the consumer may have changed
        # them while paused after prefill.
        self._sampler = Sampler(self.sampling, self.engine.device)
        self._stages = self._new_stages(state)
        state.weight_bytes = self.engine.runner.model.decode_weight_bytes  # once: it sums every tensor
        chosen: Chosen | None = None  # what the step chose from `logits`, when the engine samples (unsteered)
        while True:
            self.pending_logits = logits
            self._held_step = (state.fed[-1], len(state.fed) - 1)
            yield StepReady(len(state.generated), self._step_path(state))
            self._held_step = None
            if self.cancelled.is_set():
                finish = "cancelled"
                break
            if chosen is None:
                token, trace, forced = self._sample(logits)
            else:
                token, trace, forced = chosen.token, chosen.trace, False
            self.pending_logits = None
            inspection = self._inspection(logits, token)
            event, finish = self._stream(token, trace, forced, cache, state, inspection)
            yield event
            finish = finish or self._stop_after_step(state)
            if finish is not None:
                break
            if self.steered:
                self._start_step(state)
                logits, _ = yield from self._forward_or_recompute((token,), state.pos, state)
                state.batch = self._member.last_step if self._member is not None else None
            else:
                decoded = yield from self._run_ahead(token, state)
                if decoded is None:  # the loop stopped feeding it: cancelled meanwhile
                    finish = "cancelled"
                    break
                logits, chosen = decoded.logits, decoded.chosen
            state.pos += 1
        if finish != "stop_sequence":
            # Nothing after a stop string is shown; any other ending releases the text still
            # held back (a possible stop-string start, an incomplete character).
            state.text_parts.append(state.stopper.flush() + state.detok.flush())
        return finish

    def _run_ahead(self, token: int, state: DecodeState) -> Generator[Event, None, Decoded | None]:
        """Unsteered decode: the next step the engine ran ahead for this request (starting the run
        ahead with `token` the first time), its facts noted on `state`; None when the loop stopped
        feeding it. Preempted, the request says so with a `PreemptEvent` and runs ahead again from
        position 0 with every token it had fed, then `token` (recompute)."""
        member = self._member
        assert member is not None
        if self._ahead is None:
            assert self._stages is not None
            self._chooser = RequestChooser(
                self.request, self._stages, self.engine.tokenizer.eos_ids, self.engine.cfg.max_position_embeddings
            )
            self._ahead = member.run_ahead((token,), state.pos, self._chooser)
            unconfirmed: tuple[int, ...] | None = (token,)  # fed by the run ahead, its step not yet seen
        else:
            unconfirmed = None
        while True:
            try:
                decoded = member.decoded(self._ahead)
                break
            except Preempted as preempted:
                # Everything fed so far, then what the preempted work would have fed: the run
                # ahead's start (itself a recompute, when preempted again before its first step) or `token`.
                ids = (*state.fed, *(unconfirmed or (token,)))
                unconfirmed = ids
                del state.fed[:]
                yield self._preempted(preempted, len(ids))
                assert self._chooser is not None
                self._ahead = member.run_ahead(ids, 0, self._chooser)
        if decoded is None:
            return None
        state.fed.extend(decoded.fed)
        state.step_start, state.step_held_ns = decoded.handed_in, self._held_ns
        state.batch, state.kv_lengths = decoded.step, decoded.kv_lengths
        return decoded

    def _inspection(self, logits: torch.Tensor, token: int) -> StepInspection | None:
        """The captured step's records, if this step was captured: its lens runs the head over
        every layer's residual, model work, so on the model thread (`threads.model_thread`)."""
        if not self._capture.pending:
            return None
        model = self.engine.runner.model
        return model_thread().call(lambda: self._capture.inspection(model, logits, token))

    def _sample(self, logits: torch.Tensor) -> tuple[int, StepTrace | None, bool]:
        """Sampling: the next token (the forced one, if set), its trace when asked for, and whether forced."""
        forced, self._forced = self._forced, None
        # One row's sampling is too small to share out, and it runs on the consumer's thread, not
        # the model thread: a parallel region here would give this thread an OpenMP team of its
        # own, and once teams outnumber the cores every worker sleeps between regions
        # (`threads.ModelThread`), so each region of a step would wait for a wake-up.
        # The stages before the filters (grammar, min_tokens, bias, penalties) come first, and the
        # token is committed to them; even a forced one is drawn for, so the generator advances as
        # in the traced path.
        req, stages = self.request, self._stages
        assert stages is not None
        with OneThread(logits.device):
            summary = self._member.summary if req.trace and self._member is not None else None  # these logits only
            token, trace = stages.pick(logits, traced=req.trace, top_n=req.top_n, force=forced, summary=summary)
        return token, trace, forced is not None

    def _new_stages(self, state: DecodeState) -> LogitStages:
        """The request's stages before the filters, from the first decode step: the prompt is every
        position fed so far (repetition_penalty's), and the grammar's matcher starts at its beginning."""
        assert self._sampler is not None
        tok, req = self.engine.tokenizer, self.request
        return LogitStages(
            self._sampler,
            tok.piece,
            prompt_ids=state.fed,
            end_ids=set(tok.eos_ids) | set(req.stop_token_ids),
            min_tokens=req.min_tokens,
            grammar=GrammarMatcher(self._grammar, tok) if self._grammar is not None and self._grammar_wanted else None,
        )

    def _stream(
        self,
        token: int,
        trace: StepTrace | None,
        forced: bool,
        cache: KVCache | PagedKVCache,
        state: DecodeState,
        inspection: StepInspection | None = None,
    ) -> tuple[TokenEvent, str | None]:
        """Streaming: commit `token` and release the text it makes visible.

        Returns its event and, when the token itself ends the request, why: "stop" (end of
        sequence, or one of the request's stop_token_ids) or "stop_sequence" (it completed a
        stop string). Neither ends the request before min_tokens tokens (vLLM's rule: a stop
        token counts once that many are out, a stop string only from the next token on).
        """
        tok, tl = self.engine.tokenizer, self.timeline
        state.generated.append(token)
        index = len(state.generated) - 1
        req, count = self.request, len(state.generated)
        eos = token in tok.eos_ids
        # Before min_tokens a stop token can only be a forced one: sampling masks them out.
        stops = stops_at(req, tok.eos_ids, token, count)
        text = "" if eos or stops else state.detok.push(token)  # EOS, and the stop token that ends, add no text
        if count > req.min_tokens:
            visible, stop_hit = state.stopper.push(text)
        else:  # no stop string may end the request yet, so none is held back either
            visible, stop_hit = text, False
        t = tl.mark("token", str(token))
        if visible:
            state.text_parts.append(visible)
            if state.first_visible_index is None:
                state.first_visible_index = index
                tl.mark("first_visible_token", f"token {index + 1}", t_ms=t)
            state.last_visible = (index, t)
        state.peak = cache.usage(state.kv_lengths)
        event = TokenEvent(
            index=index,
            token_id=token,
            piece=tok.piece(token),
            text=visible,
            t_ms=t,
            itl_ms=None if state.previous_t is None else t - state.previous_t,
            step_ms=(time.perf_counter() - state.step_start) * 1000 - (self._held_ns - state.step_held_ns) / 1e6,
            kv=state.peak,
            trace=trace,
            forced=forced,
            held_ms=self._held_since_previous(state),
            bytes_read=self._bytes_read(index, state),
            batch=state.batch if index else None,
            inspection=inspection,
            path=self._step_path(state),
            last=stops or stop_hit or count >= req.max_tokens,
        )
        state.previous_t = t
        return event, "stop" if stops else "stop_sequence" if stop_hit else None

    def _step_path(self, state: DecodeState) -> str:
        """The path of the step behind the waiting token: its shared step, or prefill's last chunk."""
        step = state.batch or (self._member.last_step if self._member is not None else None)
        return step.path if step is not None else ""

    def _bytes_read(self, index: int, state: DecodeState) -> StepBytes | None:
        """What the step behind token `index` read: the shared step's whole read when others shared
        it, else this request's weights and K/V; None for token 0, which prefill produced."""
        if not index:
            return None
        shared = state.batch
        if shared is not None and shared.sequences > 1 and shared.bytes_read is not None:
            return shared.bytes_read
        return step_bytes(state.weight_bytes, state.peak)

    def _stop_after_step(self, state: DecodeState) -> str | None:
        """Why decode ends after a token that did not end it itself: "length", "cancelled" or None."""
        if length_reached(self.request, len(state.generated), state.pos, self.engine.cfg.max_position_embeddings):
            return "length"
        if self.cancelled.is_set():
            return "cancelled"
        return None

    def _complete(self, finish: str, error: str | None, state: DecodeState, reached: Reached) -> Iterator[Event]:
        """Completion: close decode's span, mark completion and report the result."""
        tl = self.timeline
        if state.last_visible is not None:
            index, t = state.last_visible
            # Only now is it known which visible token was the last; its mark is dated back to it.
            tl.mark("last_visible_token", f"token {index + 1}", t_ms=t)
            yield StageEvent("decode", tl.time_of("prefill_end") or t, t)
        yield self._stage("completed", finish)
        self.result = self._result(finish, error, state, reached)
        yield DoneEvent(self.result)

    # -- helpers ---------------------------------------------------------------------------------

    def _stage(self, end_event: str, detail: str = "") -> StageEvent:
        t_end = self.timeline.mark(end_event, detail)
        stage, start_event = _STAGE_BY_END[end_event]
        return StageEvent(stage, self.timeline.time_of(start_event) or t_end, t_end, detail)

    def _start_step(self, state: DecodeState) -> None:
        """Note when the model step behind the next token begins, and the held time so far."""
        state.step_start = time.perf_counter()
        state.step_held_ns = self._held_ns

    def _held_since_previous(self, state: DecodeState) -> float:
        """Held time (ms) since the previous token (since the send, for the first); noted per token."""
        total = self._held_ns / 1e6
        since = total - (state.held_totals[-1] if state.held_totals else 0.0)
        state.held_totals.append(total)
        return since

    def _new_cache(self, kv: KVSizing) -> KVCache | PagedKVCache:
        """The model's KV cache for this request, sized by `kv`: blocks of the engine's pool (or
        the static decoder's arena, where it serves)."""
        req, eng = self.request, self.engine
        return eng.runner.new_cache(
            kv.tokens,
            layout=req.kv_layout,
            storage_dtype=kv.storage,
            block_size=req.block_size,
            pool=eng.pool,
            owner=req.request_id,
        )

    def _forward(self, ids: tuple[int, ...], start: int) -> tuple[torch.Tensor, list[PrefillChunk]]:
        """Run `ids` at positions from `start` in the engine's shared steps, caching their K/V in the
        request's cache; the next-token logits, and the prompt chunks the steps ran."""
        assert self._member is not None
        observer = self._capture.observer(self.engine.runner.model)
        # A traced greedy step's candidates and softmax come from the step, made with its other rows'.
        params = self._sampler.params if self._sampler is not None else self.sampling
        summarized = self.request.trace and params.greedy and self._grammar is None  # a grammar's row is another
        summarize = greedy_candidates(self.request.top_n) if summarized else None
        begun = time.perf_counter()
        out = self._member.forward(ids, start, observer, summarize)
        self._capture.ran(observer, (time.perf_counter() - begun) * 1000, len(ids))
        return out

    def _forward_or_recompute(
        self, ids: tuple[int, ...], start: int, state: DecodeState
    ) -> Generator[Event, None, tuple[torch.Tensor, list[PrefillChunk]]]:
        """`_forward`, noting what was fed; preempted (its blocks taken back for others), the
        request says so with a `PreemptEvent` and runs every token it had fed again from
        position 0, then `ids` (recompute)."""
        while True:
            try:
                out = self._forward(ids, start)
                state.fed.extend(ids)
                return out
            except Preempted as preempted:
                ids, start = tuple(state.fed[:start]) + ids, 0
                del state.fed[:]
                yield self._preempted(preempted, len(ids))

    def _preempted(self, preempted: Preempted, recompute: int) -> PreemptEvent:
        """The event that says the engine took this request's blocks back, and what it will recompute."""
        return PreemptEvent(
            preempted.reason,
            preempted.blocks_freed,
            preempted.bytes_freed,
            tokens_to_recompute=recompute,
            t_ms=self.timeline.now_ms(),
        )

    def _keep_blocks(
        self, cache: KVCache | PagedKVCache, ids: tuple[int, ...], state: DecodeState, admitted: AdmittedKV
    ) -> None:
        """Give the cache's full blocks to the prefix cache, within the KV budget.

        Whatever the ending: every position all layers hold is the model's K/V for the tokens
        fed so far (a pass that failed partway leaves later layers shorter, and only what all
        layers hold is kept). Runs before the cache and the admission are released, so no other
        request can take the static decoder's arena or the budget meanwhile.
        """
        assert admitted.prefix is not None
        pool, identity = admitted.prefix.pool, admitted.prefix.identity
        try:
            fresh = pool.fresh_blocks(cache, ids + tuple(state.generated), identity)
        except torch.OutOfMemoryError:
            return  # no memory for the copies: nothing is kept, the request is unaffected
        if fresh.new:
            self.engine.scheduler.within_budget(lambda room: pool.store(fresh, room), releasing=admitted.admission)
        else:
            pool.store(fresh, 0)  # nothing new: the chain only becomes most recently used

    def _result(self, finish: str, error: str | None, state: DecodeState, reached: Reached) -> RequestResult:
        tl = self.timeline
        metrics = engine_metrics = None
        if state.first_visible_index is not None and state.last_visible is not None:
            visible = slice(state.first_visible_index, state.last_visible[0] + 1)
            token_times = tl.token_times()[visible]
            send_ms = tl.time_of("client_send") or 0.0
            metrics = request_metrics(
                send_ms=send_ms,
                first_ms=tl.time_of("first_visible_token"),
                last_ms=state.last_visible[1],
                output_tokens=len(token_times),
                token_times_ms=token_times,
            )
            # The same formulas on the engine's clock: each token's time less what was held before it.
            engine_times = without_held(token_times, state.held_totals[visible])
            engine_metrics = request_metrics(
                send_ms, engine_times[0], engine_times[-1], len(engine_times), engine_times
            )
        return RequestResult(
            request_id=self.request.request_id,
            finish_reason=finish,
            text=state.text,
            token_ids=tuple(state.generated),
            usage=Usage(
                reached.prompt_tokens, len(state.generated), reached.prefix.reused_tokens if reached.prefix else 0
            ),
            timeline=tuple(tl.events),
            stages=tl.stages(),
            metrics=metrics,
            queue_ms=reached.queue_ms,
            kv_peak=state.peak,
            sampler_order=self.sampling.order,
            error=error,
            engine_metrics=engine_metrics,
            held_ms=self._held_ns / 1e6,
            prefix_cache=reached.prefix,
            batch=None if reached.member is None else _batch_summary(reached.member),
        )


def _batch_summary(member: Member) -> BatchSummary:
    return BatchSummary.of(member.steps, member.prefill_chunks, member.preemptions)
