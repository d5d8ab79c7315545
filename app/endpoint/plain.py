"""Plain text for an endpoint request: the answer on stdout, the client's timeline and summary on stderr."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator, Callable
from typing import TextIO

from minengine.kv.arithmetic import KIB, MIB
from minengine.plan.planner import Plan
from reqscope.console.latency_lines import ChunkStream, latency_lines
from reqscope.endpoint import events as ev
from reqscope.endpoint.client_metrics import prompt_count
from reqscope.endpoint.controls import OutputControls, shape_line
from reqscope.endpoint.server.reconcile import spike_marks
from reqscope.endpoint.server.records import VLLM, ServerView
from reqscope.endpoint.server.sglang import meta_info_line
from reqscope.endpoint.server.words import batch_lines, prompt_line, split_line
from reqscope.endpoint.settings import LOGPROBS_COST_NOTE, RequestSettings, logprobs_text, settings_text
from reqscope.endpoint.tool_calls import arguments_problem, tool_call_text


async def print_endpoint_plain(
    events: AsyncIterator[ev.ClientEvent],
    kv_plan_for: Callable[[ev.EndpointResult], Plan | None] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> ev.EndpointResult:
    """Stream `events` as text; `kv_plan_for(result)` may return the planner's KV. Returns the result."""
    out = out or sys.stdout
    err = err or sys.stderr

    def note(line: str) -> None:
        print(line, file=err, flush=True)

    result: ev.EndpointResult | None = None
    sent: ev.RequestSent | None = None
    async for event in events:
        if isinstance(event, ev.RequestSent):
            sent = event
            note(f"· endpoint  {event.url}  model {event.model}")
            asked = settings_text(event.settings, event.token_limit_field)
            note(f"· sent      {asked}; {logprobs_text(event.settings)}")
            for line in event.controls.lines():
                note(f"· asked     {line}")
        elif isinstance(event, ev.ConnectionReady):
            how = "reused connection" if event.reused else f"new connection, opened in {event.connect_ms or 0:.2f} ms"
            note(f"· connect   {event.t_ms:9.2f} ms  {how}")
        elif isinstance(event, ev.ResponseStarted):
            note(f"· response  {event.t_ms:9.2f} ms  HTTP {event.status}  x-request-id {event.request_id or '-'}\n")
        elif isinstance(event, ev.ChunkReceived):
            out.write(event.text)
            out.flush()
        elif isinstance(event, ev.StreamEnded):
            result = event.result
            out.write("\n")  # the answer ends here: what follows on stderr starts on a line of its own
            for i, call in enumerate(result.tool_calls):  # a tool call is the answer, so it goes to stdout
                out.write(f"[tool call {i}] {tool_call_text(call)}\n")
            out.flush()
            if _waits_for_span(result):
                note("· waiting for the server's trace span (vLLM exports them every few seconds)")
        elif isinstance(event, ev.SpanReceived) and result is not None:
            result = dataclasses.replace(result, server_view=event.view)
    assert result is not None, "a stream always ends with StreamEnded"
    plan = kv_plan_for(result) if kv_plan_for is not None and result.usage is not None else None
    settings = sent.settings if sent is not None else None
    controls = sent.controls if sent is not None else None
    note(endpoint_summary(result, plan, planner_asked=kv_plan_for is not None, settings=settings, controls=controls))
    return result


def endpoint_summary(
    r: ev.EndpointResult,
    plan: Plan | None = None,
    planner_asked: bool = False,
    settings: RequestSettings | None = None,
    controls: OutputControls | None = None,
) -> str:
    """The client-side timing summary, the tool calls and output shape, the server's view beside it when it
    sent one, and the logprobs' cost."""
    lines = [""]
    if r.error:
        lines.append(f"error: {r.error}")
    usage = f"prompt {prompt_count(r.usage)} tokens, " if r.usage else ""
    lines.append(
        f"finish    {r.finish_reason or '-'}   {usage}output {r.output_tokens} tokens "
        f"(counted from {r.output_tokens_source}), {r.chunks} chunks"
    )
    lines += output_lines(r, controls)
    m = r.metrics
    if m is not None:
        lines += latency_lines(m, ChunkStream(r.chunks, r.output_tokens))
    lines += server_view_lines(r)
    if settings is not None and settings.logprobs:
        lines.append(logprobs_cost_line(r, settings))
    lines.append(_kv_line(plan, planner_asked))
    return "\n".join(lines)


def output_lines(r: ev.EndpointResult, controls: OutputControls | None) -> list[str]:
    """The tool calls the answer made, whether its text took the shape asked for, and the tools' prompt cost."""
    lines = []
    for i, call in enumerate(r.tool_calls):
        lines.append(f"tool call {i}  {call.id or '(no id)'}  {tool_call_text(call)}")
        if (problem := arguments_problem(call)) is not None:
            cut = " (finish_reason length: the answer was cut off)" if r.finish_reason == "length" else ""
            lines.append(f"          ! {problem}{cut}")
    if controls is not None and controls.structured is not None and not r.error:
        lines.append(f"output    {shape_line(controls.structured, r.text)}")
    view = r.server_view
    if view is not None and view.tools_cost is not None:
        lines.append(f"tools     {view.tools_cost.line()}")
    elif view is not None and view.tools_cost_error is not None:
        lines.append(f"tools     prompt cost not counted: {view.tools_cost_error}")
    return lines


def _waits_for_span(r: ev.EndpointResult) -> bool:
    view = r.server_view
    return view is not None and view.kind.name == VLLM and view.span is None and r.error is None and not any(
        o.flag == "--otlp-traces-endpoint" for o in view.off
    )


def server_view_lines(r: ev.EndpointResult) -> list[str]:
    """The server's own figures (its report or timings, its span, metrics and batch) beside the client's,
    and one line for each view it could give but did not."""
    if r.error:
        return []
    lines = []
    view = r.server_view
    if view is not None:
        lines += _view_lines(view, r)
    if r.ttft is not None:
        t = r.ttft
        named = (("gateway", t.gateway_ms), ("queue", t.queue_ms), ("prefill", t.prefill_ms))
        parts = [f"{name} {ms:.2f}" for name, ms in named if ms is not None]
        lines.append(f"server    TTFT {t.server_ms:9.2f} ms on its clock ({', '.join(parts)} ms)")
        lines.append(
            f"          client TTFT {t.client_ms:.2f} ms: {t.outside_server_ms:.2f} ms outside the server "
            "(connection, network, HTTP)"
        )
    if r.timings is not None:
        lines.append(f"server    llama.cpp timings, on its clock: {timings_text(r.timings)}")
        if r.metrics is not None and r.timings.prompt_ms is not None:
            lines.append(
                f"          client TTFT {r.metrics.ttft_ms:.2f} ms: {r.metrics.ttft_ms - r.timings.prompt_ms:.2f} ms "
                "beyond the server's prompt time (queue, tokenizing, network, HTTP)"
            )
    if r.tpot is not None:
        c = r.tpot
        who = "its report" if c.source == "reqscope" else "its timings"
        lines.append(
            f"{'' if lines else 'server':<10}TPOT {c.server_ms:.2f} ms/token on its clock ({who}); client "
            f"TPOT {c.client_ms:.2f}: {c.outside_server_ms:.2f} ms/token outside its decode "
            "(streaming, network, client)"
        )
    if r.server is None and r.timings is None and (view is None or view.ttft_split is None):
        lines.append("server    sent no timing report (reqscope serve, vLLM and llama.cpp's server can send one)")
    if view is not None:
        lines += [f"off       {o.line()}" for o in view.off]
    return lines


def _view_lines(view: ServerView, r: ev.EndpointResult) -> list[str]:
    kind = view.kind.name + (f" {view.kind.version}" if view.kind.version else "")
    name = f"{view.display_id} (X-Request-Id {view.request_id})" if view.display_id else view.request_id
    lines = [f"server    {kind} at {view.kind.root}, request {name}"]
    if view.ttft_split is not None:
        lines.append(f"          {split_line(view.ttft_split)}")
        if view.ttft_split.clock_note:
            lines.append(f"          ! {view.ttft_split.clock_note}")
    m = view.vllm_metrics
    if m is not None:
        figures = (("queue", m.queue_time_ms), ("TTFT from scheduling", m.time_to_first_token_ms),
                   ("generation", m.generation_time_ms), ("mean ITL", m.mean_itl_ms))
        shown = ", ".join(f"{name} {ms:.1f} ms" for name, ms in figures if ms is not None)
        lines.append(f"          vLLM per-request metrics: {shown}")
    if view.span is not None:
        s = view.span
        figures = (("queue", s.queue_ms), ("prefill", s.prefill_ms), ("decode", s.decode_ms), ("e2e", s.e2e_ms))
        shown = ", ".join(f"{name} {ms:.1f} ms" for name, ms in figures if ms is not None)
        lines.append(f"          vLLM span llm_request: {shown}")
    if view.sglang_meta is not None:
        lines.append(f"          {meta_info_line(view.sglang_meta)}")
    if view.progress:
        last = view.progress[-1]
        lines.append(f"          prompt progress: {len(view.progress)} updates, {last.processed}/{last.total} tokens "
                     f"({last.cache} from its cache) in {last.time_ms:.1f} ms (llama-server prompt_progress)")
    lines += [f"batch     {line}" for line in batch_lines(view)]
    for mark in spike_marks([t for t in _chunk_times(r)], view.batch):
        lines.append(f"          ITL spike at chunk {mark.chunk}: {mark.itl_ms:.1f} ms "
                     f"({mark.itl_ms / mark.median_ms:.1f}x the median): {mark.reason}")
    prompt = prompt_line(view, r.usage.prompt_tokens if r.usage else None)
    if prompt:
        lines.append(f"prompt    {prompt}")
    return lines


def _chunk_times(r: ev.EndpointResult) -> list[float]:
    return [e.t_ms for e in r.timeline if e.name == "token"]


def timings_text(t: ev.ServerTimings) -> str:
    """llama.cpp's timings in one line: the prompt, then generation."""
    parts = []
    if t.prompt_ms is not None:
        prompt = f"prompt {t.prompt_n if t.prompt_n is not None else '?'} tokens in {t.prompt_ms:.2f} ms"
        if t.cache_n:
            prompt += f" (+{t.cache_n} from its cache)"
        parts.append(prompt)
    if t.predicted_ms is not None:
        made = f"generated {t.predicted_n if t.predicted_n is not None else '?'} tokens in {t.predicted_ms:.2f} ms"
        if t.predicted_per_token_ms is not None:
            made += f", {t.predicted_per_token_ms:.2f} ms/token"
        if t.predicted_per_second is not None:
            made += f" ({t.predicted_per_second:.2f} tokens/s)"
        parts.append(made)
    if t.draft_n is not None and t.draft_n_accepted is not None:
        parts.append(f"drafted {t.draft_n}, accepted {t.draft_n_accepted}")
    return "; ".join(parts)


def logprobs_cost_line(r: ev.EndpointResult, settings: RequestSettings) -> str:
    """The note a request with logprobs carries: they may have slowed the server, by how much is in TPOT."""
    if r.metrics is not None and r.metrics.tpot_ms is not None:
        cost = f"the TPOT above ({r.metrics.tpot_ms:.2f} ms/token) includes their cost"
    else:
        cost = "the times above include their cost"
    got = f"returned for {r.logprob_tokens} tokens" if r.logprob_tokens else "none returned"
    asked = logprobs_text(settings).removeprefix("logprobs ")
    return f"logprobs  {asked}, {got}: {LOGPROBS_COST_NOTE}, so {cost} (run with --no-logprobs to compare)"


def _kv_line(plan: Plan | None, planner_asked: bool) -> str:
    if plan is None:
        hint = "" if planner_asked else " (pass --card MODEL for the planner's figures)"
        return f"KV        not exposed by the endpoint{hint}"
    mem = plan.memory
    return (
        f"KV        not exposed by the endpoint; computed by the planner for {plan.arch.name} "
        f"({plan.inputs.kv_dtype}): {mem.kv_bytes_per_token / KIB:.1f} KiB/token, prompt "
        f"{mem.prompt_kv_bytes / MIB:.2f} MiB, at stop {mem.stop_kv_bytes / MIB:.2f} MiB ({mem.stop_kv_tokens} tokens)"
    )
