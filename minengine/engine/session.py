"""One request's life in the engine: gateway, template, tokenize, admit, prefill, decode, complete.

A RequestSession is an iterator of events. The consumer drives it: every pull runs the engine
up to the next event, so a consumer that stops pulling at a `StepReady` has paused decode
with the next token's logits computed and waiting. While paused it may preview the step with
other sampling parameters, force the next token, or change the parameters for the steps that
follow. `cancel()` may be called from any thread; decode stops before the next model step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from minengine.device import synchronize
from minengine.engine.events import (
    AdmitEvent,
    DoneEvent,
    Event,
    PrefillEvent,
    PromptEvent,
    PromptPart,
    RequestResult,
    StageEvent,
    StepReady,
    TokenEvent,
    Usage,
)
from minengine.engine.metrics import request_metrics
from minengine.engine.request import GenerationRequest, validate
from minengine.engine.scheduler import Admission
from minengine.engine.timeline import STAGE_SPANS, Timeline
from minengine.errors import ReqscopeError, RequestError
from minengine.kv.arithmetic import blocks_for, kv_bytes_per_token
from minengine.kv.cache import KVCache, KVUsage
from minengine.sampling.sampler import Sampler, SamplingParams, StepTrace, explain, filter_logits
from minengine.text.detokenizer import IncrementalDetokenizer
from minengine.text.prompt_parts import prompt_parts
from minengine.text.stop import StopMatcher

if TYPE_CHECKING:
    from minengine.engine.engine import Engine

_STAGE_BY_END = {end: (stage, start) for stage, start, end in STAGE_SPANS}
_KV_STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class RequestSession:
    """Iterate to run the request; control it between events."""

    def __init__(self, engine: Engine, request: GenerationRequest, timeline: Timeline | None = None):
        self.engine = engine
        self.request = request
        self.timeline = timeline or Timeline()
        if self.timeline.time_of("client_send") is None:
            self.timeline.mark("client_send", "request created")
        self.cancelled = threading.Event()
        self.sampling: SamplingParams = request.sampling
        self.pending_logits: torch.Tensor | None = None
        self.result: RequestResult | None = None
        self.prompt_tokens = 0
        self.failure: ReqscopeError | None = None  # why the request failed, for callers that map errors
        self._forced: int | None = None
        self._sampler: Sampler | None = None
        self._cache: KVCache | None = None
        self._admission: Admission | None = None

    # -- control, from the consumer (or, for cancel, any thread) -----------------------------

    def cancel(self) -> None:
        """Stop the request before its next model step."""
        self.cancelled.set()

    def force_next(self, token_id: int) -> None:
        """Make the next step commit `token_id` instead of sampling."""
        if not 0 <= token_id < self.engine.cfg.vocab_size:
            raise RequestError(f"token id {token_id} is outside the vocabulary (0..{self.engine.cfg.vocab_size - 1})")
        self._forced = token_id

    def update_sampling(self, params: SamplingParams) -> None:
        """Use `params` from the next step on (validated first)."""
        params.validate()
        self.sampling = params
        if self._sampler is not None:
            self._sampler.update(params)

    def preview(self, params: SamplingParams | None = None, top_n: int | None = None) -> StepTrace | None:
        """Explain the waiting step under `params` without sampling or running the model.

        The chosen token shown is the forced one, else the most likely survivor of the chain.
        """
        if self.pending_logits is None:
            return None
        params = params or self.sampling
        filtered, _ = filter_logits(self.pending_logits, params)
        chosen = self._forced if self._forced is not None else int(filtered.argmax())
        return explain(
            self.pending_logits,
            params,
            chosen,
            self.engine.tokenizer.piece,
            top_n=top_n or self.request.top_n,
            forced=self._forced is not None,
        )

    # -- the lifecycle -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Event]:
        return self._run()

    def _stage(self, end_event: str, detail: str = "") -> StageEvent:
        t_end = self.timeline.mark(end_event, detail)
        stage, start_event = _STAGE_BY_END[end_event]
        return StageEvent(stage, self.timeline.time_of(start_event) or t_end, t_end, detail)

    def _run(self) -> Iterator[Event]:
        eng, req, tl = self.engine, self.request, self.timeline
        tok = eng.tokenizer
        if tl.time_of("server_arrival") is None:  # a server marks it itself, when the HTTP request lands
            tl.mark("server_arrival", req.request_id)
        generated: list[int] = []
        finish, error = "error", None
        text_parts: list[str] = []
        first_visible_index: int | None = None
        last_visible: tuple[int, float] | None = None
        peak: KVUsage | None = None
        try:
            validate(req)
            yield self._stage("validated", req.request_id)
            if req.raw_prompt is None:
                rendered = tok.render(list(req.messages))
                yield self._stage("templated", f"{len(rendered)} chars")
            else:
                rendered = req.raw_prompt
                yield self._stage("templated", "raw prompt, no chat template")
            pieces = tok.encode_pieces(rendered)
            ids = [p.token_id for p in pieces]
            self.prompt_tokens = len(ids)
            yield self._stage("tokenized", f"{len(ids)} tokens")
            if req.raw_prompt is None:
                without_gen = tok.render(list(req.messages), add_generation_prompt=False)
                parts = prompt_parts(rendered, without_gen, req.messages, pieces)
            else:
                parts = (PromptPart("user", len(pieces)),)
            yield PromptEvent(rendered, tuple(pieces), parts)

            storage = eng.dtype if req.kv_dtype == "auto" else _KV_STORAGE[req.kv_dtype]
            heads = eng.cfg.num_attention_heads if req.kv_layout == "mha" else eng.cfg.num_key_value_heads
            elem = torch.empty((), dtype=storage).element_size()
            per_token = kv_bytes_per_token(eng.cfg.num_hidden_layers, heads, eng.cfg.head_dim, elem)
            budget_tokens = len(ids) + req.max_tokens
            kv_needed = blocks_for(budget_tokens, req.block_size) * req.block_size * per_token
            self._admission = eng.scheduler.admit(
                req.request_id,
                prompt_tokens=len(ids),
                max_tokens=req.max_tokens,
                context_limit=eng.cfg.max_position_embeddings,
                kv_bytes=kv_needed,
                cancelled=self.cancelled,
            )
            yield self._stage("scheduler_admit", f"queue {self._admission.queue_ms:.1f} ms")
            yield AdmitEvent(
                len(ids),
                req.max_tokens,
                eng.cfg.max_position_embeddings,
                kv_needed,
                eng.scheduler.kv_budget_bytes,
                self._admission.queue_ms,
            )

            self._cache = cache = eng.model.new_cache(
                budget_tokens, layout=req.kv_layout, storage_dtype=storage, block_size=req.block_size
            )
            tl.mark("prefill_start", f"{len(ids)} tokens")
            step_start = time.perf_counter()
            logits = eng.model.forward(torch.tensor(ids, device=eng.device), 0, cache)
            synchronize(eng.device)
            prefill_stage = self._stage("prefill_end")
            yield prefill_stage
            peak = cache.usage()
            yield PrefillEvent(len(ids), prefill_stage.duration_ms, peak)

            self._sampler = Sampler(self.sampling, eng.device)
            detok = IncrementalDetokenizer(tok.tok)
            stopper = StopMatcher(req.stop)
            pos = len(ids)
            previous_t: float | None = None
            while True:
                self.pending_logits = logits
                yield StepReady(len(generated))
                if self.cancelled.is_set():
                    finish = "cancelled"
                    break
                forced, self._forced = self._forced, None
                trace = None
                if req.trace:
                    token, trace = self._sampler.sample_traced(logits, tok.piece, req.top_n, force=forced)
                else:
                    # Draw even when forced, so the generator advances as in the traced path.
                    token = self._sampler.sample(logits)
                    token = forced if forced is not None else token
                self.pending_logits = None
                generated.append(token)
                eos = token in tok.eos_ids
                visible, stop_hit = stopper.push("" if eos else detok.push(token))
                t = tl.mark("token", str(token))
                if visible:
                    text_parts.append(visible)
                    if first_visible_index is None:
                        first_visible_index = len(generated) - 1
                        tl.mark("first_visible_token", f"token {len(generated)}", t_ms=t)
                    last_visible = (len(generated) - 1, t)
                peak = cache.usage()
                yield TokenEvent(
                    index=len(generated) - 1,
                    token_id=token,
                    piece=tok.piece(token),
                    text=visible,
                    t_ms=t,
                    itl_ms=None if previous_t is None else t - previous_t,
                    step_ms=(time.perf_counter() - step_start) * 1000,
                    kv=peak,
                    trace=trace,
                    forced=forced is not None,
                )
                previous_t = t
                if eos:
                    finish = "stop"
                    break
                if stop_hit:
                    finish = "stop_sequence"
                    break
                if len(generated) >= req.max_tokens or pos + 1 >= eng.cfg.max_position_embeddings:
                    finish = "length"
                    break
                if self.cancelled.is_set():
                    finish = "cancelled"
                    break
                step_start = time.perf_counter()
                logits = eng.model.forward(torch.tensor([token], device=eng.device), pos, cache)
                pos += 1
            if finish not in ("stop_sequence",):
                tail = stopper.flush() + detok.flush()
                text_parts.append(tail)
        except ReqscopeError as exc:
            finish, error = "error", str(exc)
            self.failure = exc
        except torch.OutOfMemoryError as exc:
            finish, error = "error", f"out of memory: {str(exc).splitlines()[0]}; lower --max-tokens"
        finally:
            self.pending_logits = None
            if self._cache is not None:
                self._cache.release()
                self._cache = None
            if self._admission is not None:
                eng.scheduler.release(self._admission)
        if last_visible is not None:
            tl.mark("last_visible_token", f"token {last_visible[0] + 1}", t_ms=last_visible[1])
            yield StageEvent("decode", tl.time_of("prefill_end") or last_visible[1], last_visible[1])
        yield self._stage("completed", finish)
        self.result = self._result(
            finish, error, generated, "".join(text_parts), first_visible_index, last_visible, peak
        )
        yield DoneEvent(self.result)

    def _result(self, finish, error, generated, text, first_index, last_visible, peak) -> RequestResult:
        tl = self.timeline
        metrics = None
        if first_index is not None and last_visible is not None:
            token_times = tl.token_times()[first_index : last_visible[0] + 1]
            metrics = request_metrics(
                send_ms=tl.time_of("client_send") or 0.0,
                first_ms=tl.time_of("first_visible_token"),
                last_ms=last_visible[1],
                output_tokens=len(token_times),
                token_times_ms=token_times,
            )
        admit = self._admission
        return RequestResult(
            request_id=self.request.request_id,
            finish_reason=finish,
            text=text,
            token_ids=tuple(generated),
            usage=Usage(self.prompt_tokens, len(generated)),
            timeline=tuple(tl.events),
            stages=tl.stages(),
            metrics=metrics,
            queue_ms=admit.queue_ms if admit else 0.0,
            kv_peak=peak,
            sampler_order=self.sampling.order,
            error=error,
        )
