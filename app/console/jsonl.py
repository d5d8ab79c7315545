"""Headless JSON mode: one JSON object per line, flushed as each event happens."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, TextIO

from minengine.engine.batch_facts import BatchStep
from minengine.engine.events import (
    DoneEvent,
    Event,
    PreemptEvent,
    PrefillEvent,
    PrefixCacheEvent,
    PromptEvent,
    RequestResult,
    StageEvent,
    TokenEvent,
)
from minengine.engine.request import GenerationRequest, setting_value
from minengine.record.telemetry import block_sharing_json
from reqscope.console.inspection_json import inspection_keys
from reqscope.console.json_out import emit, metrics_json
from reqscope.console.roofline_lines import PrefillFacts, done_keys, prefill_keys, summary_of, token_keys
from reqscope.console.tool_facts import adjustments_json, prompt_record, reply_calls, tool_calls_json

if TYPE_CHECKING:
    from reqscope.bench.ceiling import CeilingLookup
    from reqscope.engine_load import LoadNote

if TYPE_CHECKING:
    from minengine.checkpoint.weight_format import WeightChoice
    from minengine.settings import Settings


def print_jsonl(
    events: Iterable[Event],
    out: TextIO | None = None,
    request: GenerationRequest | None = None,
    ceiling: CeilingLookup | None = None,
    weights: WeightChoice | None = None,
    load: LoadNote | None = None,
    settings: Settings | None = None,
    prefill: PrefillFacts | None = None,
) -> RequestResult:
    """Write stage, token and done (or error) records; return the result.

    Given the request, a first `request` record says each sampling value and where it came from.
    Each token record says what its decode step read and, given this machine's read `ceiling`,
    the time the ceiling allows it (`roofline_ms`) and the fraction of it reached; the done
    record sums them up under `roofline`; given the engine's weight format, it says which ran
    and why (`weights`). Each token record also splits the request's KV blocks by who else
    holds them (`kv_blocks`: its own, shared with other requests, shared with the prefix cache;
    null for a cache outside the pool). The batch facts come as the engine records them: each token's step
    (`batch`: the sequences sharing it, its tokens, its time against one sequence alone, the
    queue, the KV pool), a `prefill` record with the prompt's chunks, a `preempt` record when the
    engine takes the request's blocks back, and the done record's `batch` summary; a `load`
    record first says what shares the engine (`--background`, `--serve-port`). A step inspected
    (`--attention`, `--lens`) adds its `attention`, `lens` and `inspect_cost` (`inspection_json`).
    Given the engine's `settings` (`reqscope env`'s), the first record lists them as
    `engine_settings`: value, default, source and detail each (`settings` there is the request's sampling).
    A `prompt` record gives each template part's tokens (a tools' block among them); a token whose
    step ran a stage before the filters (the grammar, min_tokens, bias, penalties) carries their
    `adjustments`; given a request with tools, the done record carries the reply's `content` and
    `tool_calls`, read as the server reads them. Given the model's `prefill` facts, the done record's
    `prefill_roofline` sets the prefill's FLOPs against the compute ceiling (`roofline_lines.prefill_keys`).
    """
    out = out or sys.stdout
    result: RequestResult | None = None
    read_ceiling = None if ceiling is None else ceiling.ceiling
    tokens: list[TokenEvent] = []
    prefilled: PrefillEvent | None = None
    if request is not None and (request.setting_sources or settings is not None):
        sampling = {
            s.name: {"value": setting_value(request, s.name), "source": s.source} for s in request.setting_sources
        }
        first = {"event": "request", "request_id": request.request_id, "settings": sampling}
        emit(out, first | ({} if settings is None else {"engine_settings": settings.record()}))
    if load is not None:
        emit(out, {"event": "load", "background": load.background,
                   "serve_url": None if load.serve_url is None else f"{load.serve_url}/v1"})  # fmt: skip
    for ev in events:
        if isinstance(ev, StageEvent):
            emit(
                out,
                {
                    "event": "stage",
                    "name": ev.name,
                    "t_ms": round(ev.end_ms, 3),
                    "duration_ms": round(ev.duration_ms, 3),
                },
            )
        elif isinstance(ev, PromptEvent):
            emit(out, prompt_record(ev))
        elif isinstance(ev, PrefixCacheEvent):
            emit(out, prefix_cache_record(ev))
        elif isinstance(ev, PrefillEvent):
            prefilled = ev
            if ev.chunks:
                chunks = [asdict(c) | {"step": step_record(c.step)} for c in ev.chunks]
                emit(out, {"event": "prefill", "prompt_tokens": ev.prompt_tokens, "reused_tokens": ev.reused_tokens,
                           "duration_ms": round(ev.duration_ms, 3), "chunks": chunks})  # fmt: skip
        elif isinstance(ev, PreemptEvent):
            emit(out, {"event": "preempt"} | asdict(ev))
        elif isinstance(ev, TokenEvent):
            emit(
                out,
                {
                    "event": "token",
                    "index": ev.index,
                    "token_id": ev.token_id,
                    "text": ev.text,
                    "t_ms": round(ev.t_ms, 3),
                    "itl_ms": None if ev.itl_ms is None else round(ev.itl_ms, 3),
                    "path": ev.path,
                    "kv_logical_bytes": ev.kv.logical_bytes,
                    "kv_physical_bytes": ev.kv.physical_bytes,
                    "kv_blocks": block_sharing_json(ev.kv.sharing),
                }
                | token_keys(ev, read_ceiling)
                | ({} if ev.batch is None else {"batch": step_record(ev.batch)})
                | _adjustments_keys(ev)
                | inspection_keys(ev.inspection),
            )
            tokens.append(ev)
        elif isinstance(ev, DoneEvent):
            result = ev.result
    assert result is not None, "a session always ends with a DoneEvent"
    if result.error:
        emit(out, {"event": "error", "message": result.error})
    else:
        note = "" if ceiling is None else ceiling.note
        record = done_record(result, roofline=done_keys(summary_of(tokens, read_ceiling), note))
        if prefill is not None and prefilled is not None:
            record["prefill_roofline"] = prefill_keys(prefilled, prefill, read_ceiling)
        if weights is not None:
            record["weights"] = {"format": weights.format, "why": weights.why}
        if result.batch is not None:
            record["batch"] = asdict(result.batch)
        calls = reply_calls(request, result.text)
        if calls is not None:
            record |= tool_calls_json(calls)
        emit(out, record)
    return result


def _adjustments_keys(ev: TokenEvent) -> dict:
    """`adjustments` (grammar, min_tokens, rank changes) when a stage before the filters ran this step."""
    adjustments = ev.trace.adjustments if ev.trace is not None else None
    return {} if adjustments is None else {"adjustments": adjustments_json(adjustments)}


def step_record(step: BatchStep) -> dict:
    """One engine step as the request saw it, its pool's free bytes spelled out."""
    return asdict(step) | {"pool": asdict(step.pool) | {"free": step.pool.free}}


def prefix_cache_record(ev: PrefixCacheEvent) -> dict:
    """What the prefix cache stage found: blocks looked up and hit, prompt tokens reused and computed."""
    return {
        "event": "prefix_cache",
        "enabled": ev.enabled,
        "blocks_looked_up": ev.blocks_looked_up,
        "blocks_hit": ev.blocks_hit,
        "block_size": ev.block_size,
        "reused_tokens": ev.reused_tokens,
        "computed_tokens": ev.computed_tokens,
        "lookup_ms": round(ev.lookup_ms, 3),
        "copy_ms": round(ev.copy_ms, 3),
        "kept_blocks": ev.kept_blocks,
        "kept_bytes": ev.kept_bytes,
    }


def done_record(r: RequestResult, roofline: dict | None = None) -> dict:
    """The closing record: finish reason, usage and the request's metrics.

    `metrics` are on the wall clock, as a client sees the stream; `engine_metrics` are the same
    with `held_ms` (time the run was held at a step) taken out. Nobody holds a headless run, so
    here they are equal and `held_ms` is 0. `roofline` (`roofline_lines.done_keys`): the decode
    steps' bytes against the read ceiling, None without decode steps.
    """
    return {
        "event": "done",
        "finish_reason": r.finish_reason,
        "usage": asdict(r.usage),
        "metrics": metrics_json(r.metrics),
        "engine_metrics": metrics_json(r.engine_metrics),
        "held_ms": round(r.held_ms, 3),
        "roofline": roofline,
    }
