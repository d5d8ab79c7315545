"""Plain text for an endpoint request: the answer on stdout, the client's timeline and summary on stderr."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from typing import TextIO

from minengine.kv.arithmetic import KIB, MIB
from minengine.plan.planner import Plan
from reqscope.endpoint.events import (
    ChunkReceived,
    ClientEvent,
    ConnectionReady,
    EndpointResult,
    RequestSent,
    ResponseStarted,
    StreamEnded,
)


async def print_endpoint_plain(
    events: AsyncIterator[ClientEvent],
    kv_plan_for: Callable[[EndpointResult], Plan | None] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> EndpointResult:
    """Stream `events` as text; `kv_plan_for(result)` may return the planner's KV. Returns the result."""
    out = out or sys.stdout
    err = err or sys.stderr

    def note(line: str) -> None:
        print(line, file=err, flush=True)

    result: EndpointResult | None = None
    async for ev in events:
        if isinstance(ev, RequestSent):
            note(f"· endpoint  {ev.url}  model {ev.model}")
        elif isinstance(ev, ConnectionReady):
            how = "reused connection" if ev.reused else f"new connection, opened in {ev.connect_ms or 0:.2f} ms"
            note(f"· connect   {ev.t_ms:9.2f} ms  {how}")
        elif isinstance(ev, ResponseStarted):
            note(f"· response  {ev.t_ms:9.2f} ms  HTTP {ev.status}  x-request-id {ev.request_id or '-'}\n")
        elif isinstance(ev, ChunkReceived):
            out.write(ev.text)
            out.flush()
        elif isinstance(ev, StreamEnded):
            result = ev.result
    assert result is not None, "a stream always ends with StreamEnded"
    out.write("\n")
    out.flush()
    plan = kv_plan_for(result) if kv_plan_for is not None and result.usage is not None else None
    note(endpoint_summary(result, plan, planner_asked=kv_plan_for is not None))
    return result


def endpoint_summary(r: EndpointResult, plan: Plan | None = None, planner_asked: bool = False) -> str:
    """The client-side timing summary, with the server's view beside it when it sent one."""
    lines = [""]
    if r.error:
        lines.append(f"error: {r.error}")
    usage = f"prompt {r.usage.prompt_tokens} tokens, " if r.usage else ""
    lines.append(
        f"finish    {r.finish_reason or '-'}   {usage}output {r.output_tokens} tokens "
        f"(counted from {r.output_tokens_source}), {r.chunks} chunks"
    )
    m = r.metrics
    if m is not None:
        lines.append(f"TTFT      {m.ttft_ms:9.2f} ms (client clock, from send)")
        if m.tpot_ms is not None:
            lines.append(f"TPOT      {m.tpot_ms:9.2f} ms/token ({m.output_tokens - 1} tokens after the first)")
        if m.itl is not None:
            i = m.itl
            lines.append(
                f"ITL       per chunk: mean {i.mean:.2f}  median {i.median:.2f}  p90 {i.p90:.2f}  "
                f"p99 {i.p99:.2f}  max {i.max:.2f} ms ({i.count} gaps)"
            )
        if r.chunks and r.output_tokens > r.chunks:
            lines.append(
                f"          chunks carry {r.output_tokens / r.chunks:.2f} tokens on average, so ITL (per chunk) "
                "and TPOT (per token) differ"
            )
        rates = f"{m.whole_request_output_tokens_per_second or 0:.2f} tokens/s whole request"
        if m.decode_output_tokens_per_second is not None:
            rates += f", {m.decode_output_tokens_per_second:.2f} tokens/s decode-only"
        lines.append(f"E2E       {m.e2e_ms:9.2f} ms   ({rates})")
    if r.ttft is not None:
        t = r.ttft
        named = (("gateway", t.gateway_ms), ("queue", t.queue_ms), ("prefill", t.prefill_ms))
        parts = [f"{name} {ms:.2f}" for name, ms in named if ms is not None]
        lines.append(f"server    TTFT {t.server_ms:9.2f} ms on its clock ({', '.join(parts)} ms)")
        lines.append(
            f"          client TTFT {t.client_ms:.2f} ms: {t.outside_server_ms:.2f} ms outside the server "
            "(connection, network, HTTP)"
        )
    lines.append(_kv_line(plan, planner_asked))
    return "\n".join(lines)


def _kv_line(plan: Plan | None, planner_asked: bool) -> str:
    if plan is None:
        hint = "" if planner_asked else " (pass --config MODEL for the planner's figures)"
        return f"KV        not exposed by the endpoint{hint}"
    mem = plan.memory
    return (
        f"KV        not exposed by the endpoint; computed by the planner for {plan.arch.name} "
        f"({plan.inputs.kv_dtype}): {mem.kv_bytes_per_token / KIB:.1f} KiB/token, prompt "
        f"{mem.prompt_kv_bytes / MIB:.2f} MiB, at stop {mem.stop_kv_bytes / MIB:.2f} MiB ({mem.stop_kv_tokens} tokens)"
    )
