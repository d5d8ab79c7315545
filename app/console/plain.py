"""Headless text mode: the answer on stdout, stages and a timing summary on stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TextIO

from minengine.engine import events as ev
from minengine.engine.batch_facts import BatchSummary
from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest, settings_line
from minengine.kv.arithmetic import KIB, MIB
from reqscope.console.latency_lines import latency_lines
from reqscope.console.roofline_lines import PrefillFacts, plain_lines, plain_prefill_lines, summary_of
from reqscope.console.tool_facts import call_lines, reply_calls, run_stages, step_lines

if TYPE_CHECKING:
    from reqscope.bench.ceiling import CeilingLookup
    from reqscope.engine_load import LoadNote


def print_plain(
    engine: Engine,
    events: Iterable[ev.Event],
    out: TextIO | None = None,
    err: TextIO | None = None,
    request: GenerationRequest | None = None,
    ceiling: CeilingLookup | None = None,
    load: LoadNote | None = None,
    prefill: PrefillFacts | None = None,
) -> ev.RequestResult:
    """Stream `events` as text; return the request's result (given the request, its settings' sources too).

    Given this machine's read `ceiling`, the summary sets the decode steps' bytes against it; given the
    `prefill` facts (the model's arithmetic and the compute ceiling), the prefill's FLOPs against theirs.
    Given the `load` beside it (`--background`, `--serve-port`), a line says what shares the engine.
    After the answer, a line per step that ran a stage before the filters (the grammar's mask, min_tokens,
    bias, penalties) says what each did, and given a request with tools, a line per tool call read from it.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    result: ev.RequestResult | None = None
    tokens: list[ev.TokenEvent] = []
    prefilled: ev.PrefillEvent | None = None
    streamed = ""
    print(f"· model     {engine.describe()}  (loaded in {engine.load_ms:.0f} ms)", file=err, flush=True)
    if request is not None and request.setting_sources:
        print(f"· settings  {settings_line(request)}", file=err, flush=True)
    if load is not None:
        print(f"· load      {load_line(load)}", file=err, flush=True)
    for event in events:
        if isinstance(event, ev.StageEvent) and event.name not in ("decode", "complete", "prefix_cache"):
            print(f"· {event.name:<9} {event.duration_ms:9.2f} ms  {event.detail}", file=err, flush=True)
        elif isinstance(event, ev.PromptEvent):
            parts = " + ".join(f"{p.tokens} {p.name}" for p in event.parts)
            print(f"· prompt    {len(event.pieces)} tokens = {parts}", file=err, flush=True)
        elif isinstance(event, ev.AdmitEvent):
            print(
                f"· budget    {event.prompt_tokens}+{event.max_tokens} of {event.context_limit} tokens, "
                f"KV {event.kv_needed_bytes / MIB:.1f} of {event.kv_budget_bytes / MIB:.1f} MiB",
                file=err,
                flush=True,
            )
        elif isinstance(event, ev.PrefixCacheEvent):
            print(f"· prefix    {event.duration_ms:9.2f} ms  {prefix_cache_line(event)}", file=err, flush=True)
        elif isinstance(event, ev.PrefillEvent):
            prefilled = event  # the last: a preempted request's recompute is the prefill its tokens followed
            if len(event.chunks) > 1:
                print(f"· chunks    {chunks_line(event)}", file=err, flush=True)
            print("", file=err, flush=True)
        elif isinstance(event, ev.PreemptEvent):
            print(f"\n· preempted {preempt_line(event, len(tokens))}", file=err, flush=True)
        elif isinstance(event, ev.TokenEvent):
            tokens.append(event)
            if event.text:
                out.write(event.text)
                out.flush()
                streamed += event.text
        elif isinstance(event, ev.DoneEvent):
            result = event.result
    assert result is not None, "a session always ends with a DoneEvent"
    if result.text.startswith(streamed) and len(result.text) > len(streamed):
        out.write(result.text[len(streamed) :])
    out.write("\n")
    out.flush()
    # After the answer, not beside it: stderr's lines would cut into the streamed text on a terminal.
    for line in (line for token in tokens for line in step_lines(token)):
        print(f"· {line}", file=err, flush=True)
    calls = reply_calls(request, result.text) if not result.error else None
    for line in call_lines(calls) if calls is not None else ():
        print(f"· {line}", file=err, flush=True)
    read_ceiling = None if ceiling is None else ceiling.ceiling
    roofline = plain_lines(summary_of(tokens, read_ceiling), "" if ceiling is None else ceiling.note)
    compute = None if prefill is None or prefilled is None else plain_prefill_lines(prefilled, prefill, read_ceiling)
    print(summary(engine, result, roofline, run_stages(tokens), compute), file=err, flush=True)
    return result


def load_line(load: LoadNote) -> str:
    """What shares the engine with the request: background requests, the served API."""
    parts = [f"{load.background} background request{'s' if load.background != 1 else ''}"] if load.background else []
    if load.serve_url:
        parts.append(f"the OpenAI API at {load.serve_url}/v1")
    return f"{' and '.join(parts)} share this engine"


def chunks_line(event: ev.PrefillEvent) -> str:
    """The prompt's prefill chunks: positions, and the sequences each chunk's step ran."""
    return f"{len(event.chunks)} prefill chunks: " + ", ".join(
        f"{c.start}+{c.tokens} (step {c.step.step}, {c.step.sequences} seq, {c.step.step_ms:.1f} ms)"
        for c in event.chunks
    )


def preempt_line(event: ev.PreemptEvent, tokens_out: int) -> str:
    """A preemption as it happened: after which token, why, what it freed, what is recomputed."""
    return (
        f"after token {tokens_out} at {event.t_ms:.1f} ms: {event.reason}; {event.blocks_freed} blocks "
        f"({event.bytes_freed / MIB:.2f} MiB) freed, {event.tokens_to_recompute} tokens to recompute"
    )


def batch_line(b: BatchSummary) -> str | None:
    """The steps a request shared, for the summary; None for a request that ran alone."""
    if not (b.shared_steps or b.prefill_chunks > 1 or b.preemptions):
        return None
    return (
        f"batch     {b.shared_steps} of {b.steps} steps shared with other sequences, batch mean {b.mean_batch:.2f} "
        f"max {b.max_batch}; {b.prefill_chunks} prefill chunk{'s' if b.prefill_chunks != 1 else ''}, "
        f"{b.preemptions} preemption{'s' if b.preemptions != 1 else ''}"
    )


def prefix_cache_line(event: ev.PrefixCacheEvent) -> str:
    """What the prefix cache stage found, in words."""
    if not event.enabled:
        return f"off: {event.note}" if event.note else "off"
    if not event.blocks_hit:
        return f"0 of {event.blocks_looked_up} blocks hit: all {event.prompt_tokens} prompt tokens to prefill"
    return (
        f"{event.blocks_hit} of {event.blocks_looked_up} blocks hit: {event.reused_tokens} of {event.prompt_tokens} "
        f"prompt tokens reused, {event.computed_tokens} to prefill (copied in {event.copy_ms:.2f} ms)"
    )


def summary(
    engine: Engine,
    r: ev.RequestResult,
    roofline: list[str] | None = None,
    before: tuple[str, ...] = (),
    compute: list[str] | None = None,
) -> str:
    """A llama.cpp-style timing summary of a finished request (`roofline`: its lines, after the decode line;
    `before`: the stages that ran before the filters, named on the sampler's line; `compute`: prefill's
    roofline lines, after the prefill line)."""
    lines = [""]
    if r.error:
        lines.append(f"error: {r.error}")
    stages = {s.name: s for s in r.stages}
    lines.append(
        f"finish    {r.finish_reason}   prompt {r.usage.prompt_tokens} tokens, "
        f"output {r.usage.completion_tokens} tokens"
    )
    lines.append(f"load      {engine.load_ms:9.2f} ms")
    if "prefill" in stages:
        p = stages["prefill"].duration_ms
        n = r.usage.prompt_tokens - r.usage.cached_tokens  # what prefill computed
        reused = f", {r.usage.cached_tokens} more reused from the prefix cache" if r.usage.cached_tokens else ""
        lines.append(
            f"prefill   {p:9.2f} ms / {n:5d} tokens ({p / n:7.2f} ms/token, {1000 * n / p:8.2f} tokens/s){reused}"
        )
        lines += compute or []
    m = r.metrics
    if m is not None:
        if "decode" in stages and m.output_tokens > 1:
            d = stages["decode"].duration_ms
            lines.append(
                f"decode    {d:9.2f} ms / {m.output_tokens - 1:5d} tokens "
                f"({m.tpot_ms:7.2f} ms/token, {m.decode_output_tokens_per_second:8.2f} tokens/s)"
            )
            lines += roofline or []
        lines += latency_lines(m)
        e = r.engine_metrics
        if r.held_ms > 0 and e is not None:  # a run held at a step (never a headless one): both clocks
            lines.append(
                f"held      {r.held_ms:9.2f} ms at held steps; engine time without it: TTFT {e.ttft_ms:.2f} ms, "
                f"TPOT {e.tpot_ms or 0:.2f} ms/token, E2E {e.e2e_ms:.2f} ms (the lines above: wall clock)"
            )
        accounted = sum(s.duration_ms for s in r.stages if s.name != "complete")
        lines.append(f"unaccounted {m.e2e_ms - accounted:7.2f} ms (outside the named stages)")
    if r.kv_peak is not None:
        kv = r.kv_peak
        lines.append(
            f"KV        {kv.bytes_per_token / KIB:.1f} KiB/token ({kv.bytes_per_token} B), {kv.tokens} tokens: "
            f"logical {kv.logical_bytes / MIB:.2f} MiB, physical {kv.physical_bytes / MIB:.2f} MiB "
            f"({kv.blocks} blocks of {kv.block_size}, {kv.layout}, {kv.dtype})"
        )
    batch = batch_line(r.batch) if r.batch is not None else None
    if batch is not None:
        lines.append(batch)
    lines.append(f"sampler   logits -> {' -> '.join((*before, *r.sampler_order))} -> dist")
    return "\n".join(lines)
