"""The client's TTFT as one bar split by what the server says, and each ITL spike beside what the batch did.

The seeds' lesson: "the engine says 300 ms, the user says two seconds". A server's figures start
when it received the request; the client's start at the send. Holding both explains the gap:

- connection and HTTP: from the send until the server has the request;
- the server's queue: waiting to be scheduled;
- the server's prefill and first token: from arrival (or scheduling) to its first token, less the queue;
- delivery: from the server's first token to the client's reading of it.

Only a report on a shared clock (vLLM's span: wall-clock start times) places the server's part
inside the client's interval; the others give durations alone, so connection and delivery are
then one figure, the client's TTFT less the server's (`TtftSplit.joined`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from reqscope.endpoint.server.records import BatchSample, PromptProgress, ServerSpan, TtftSplit, VllmRequestMetrics

# Two clocks on one machine agree to well under this; past it, the screen says they disagree.
CLOCK_SLACK_MS = 2.0


def split_from_span(client_ttft_ms: float, send_unix_ms: float, span: ServerSpan) -> TtftSplit | None:
    """vLLM's span: its start (arrival) and TTFT on the wall clock place the server inside the client's TTFT.

    The span's TTFT counts from arrival; what it holds before the queue (vLLM's API: the chat
    template, tokenizing) goes with connection and HTTP, so that "prefill and first token" is the
    engine's own, as vLLM's `time_in_model_prefill`.
    """
    if span.ttft_ms is None:
        return None
    queue = span.queue_ms or 0.0
    prefill = span.prefill_ms if span.prefill_ms is not None else span.ttft_ms - queue
    api = span.ttft_ms - queue - prefill
    to_arrival = span.start_unix_ms - send_unix_ms
    delivery = client_ttft_ms - to_arrival - span.ttft_ms
    note = None
    if to_arrival < -CLOCK_SLACK_MS:
        note = f"the server's span starts {-to_arrival:.1f} ms before the client sent: the two clocks disagree"
    elif delivery < -CLOCK_SLACK_MS:
        note = (f"the server's first token comes {-delivery:.1f} ms after the client read it: "
                "the two clocks disagree")
    return TtftSplit(
        client_ttft_ms=client_ttft_ms,
        connection_http_ms=to_arrival + api,
        queue_ms=span.queue_ms,
        prefill_first_token_ms=prefill,
        delivery_ms=delivery,
        outside_ms=client_ttft_ms - span.ttft_ms,
        source="vLLM span llm_request (OTLP)",
        clock_note=note,
        server_api_ms=api,
    )


def split_from_vllm_metrics(client_ttft_ms: float, metrics: VllmRequestMetrics) -> TtftSplit | None:
    """vLLM's per-request metrics: its queue and its TTFT from scheduling, durations on its clock."""
    if metrics.time_to_first_token_ms is None:
        return None
    queue = metrics.queue_time_ms
    server = (queue or 0.0) + metrics.time_to_first_token_ms
    return _joined(client_ttft_ms, queue, metrics.time_to_first_token_ms, server, "vLLM per-request metrics")


def split_from_llama(
    client_ttft_ms: float, prompt_ms: float | None, progress: Sequence[PromptProgress] = ()
) -> TtftSplit | None:
    """llama-server's prompt time; with its progress chunks, also when the prompt started on the client's clock.

    llama-server reports no queue: a wait for a free slot falls in "connection and HTTP".
    """
    if prompt_ms is None:
        return None
    if progress:
        first = progress[0]
        # When the server began the prompt, on the client's clock: read late by the progress
        # chunk's own trip to the client, so where it leaves no room for delivery it is moved back.
        started = min(first.t_ms - first.time_ms, client_ttft_ms - prompt_ms)
        return TtftSplit(
            client_ttft_ms=client_ttft_ms,
            connection_http_ms=started,
            queue_ms=None,
            prefill_first_token_ms=prompt_ms,
            delivery_ms=client_ttft_ms - started - prompt_ms,
            outside_ms=client_ttft_ms - prompt_ms,
            source="llama-server timings + prompt_progress",
            clock_note=_over(client_ttft_ms, prompt_ms, "prompt time"),
        )
    return _joined(client_ttft_ms, None, prompt_ms, prompt_ms, "llama-server timings")


def split_from_reqscope(client_ttft_ms: float, server_ttft_ms: float, queue_ms: float | None) -> TtftSplit:
    """`reqscope serve`'s report: its TTFT from its handler's first sight of the request, and its queue."""
    prefill = server_ttft_ms - (queue_ms or 0.0)
    return _joined(client_ttft_ms, queue_ms, prefill, server_ttft_ms, "reqscope serve report")


def _joined(client: float, queue: float | None, prefill: float, server: float, source: str) -> TtftSplit:
    return TtftSplit(
        client_ttft_ms=client,
        connection_http_ms=None,
        queue_ms=queue,
        prefill_first_token_ms=prefill,
        delivery_ms=None,
        outside_ms=client - server,
        source=source,
        joined=True,
        clock_note=_over(client, server, "TTFT"),
    )


def _over(client: float, server: float, what: str) -> str | None:
    if server - client <= CLOCK_SLACK_MS:
        return None
    return f"the server's {what} ({server:.1f} ms) exceeds the client's TTFT ({client:.1f} ms): the clocks disagree"


@dataclass(frozen=True)
class SpikeMark:
    """One inter-chunk gap well above the stream's median, and what the server's batch did during it."""

    chunk: int  # the chunk that ended the gap
    itl_ms: float
    median_ms: float
    reason: str  # e.g. "waiting rose 0→3", "a preemption", "a long prompt arrived (+4,012 prompt tokens)"


SPIKE_FACTOR = 3.0  # a gap this many times the median is a spike
LONG_PROMPT_TOKENS = 1024  # prompt tokens arriving at once that make "a long prompt"


def spike_marks(chunk_times_ms: Sequence[float], samples: Sequence[BatchSample]) -> list[SpikeMark]:
    """Each ITL spike, marked with the batch's changes seen between the samples around it.

    The batch is known only at the polls, so a change is attributed to the gap when a poll that
    ended after the gap began saw it; without a poll near the gap the mark says so.
    """
    gaps = [(i, b - a) for i, (a, b) in enumerate(zip(chunk_times_ms, chunk_times_ms[1:], strict=False), start=1)]
    if len(gaps) < 3:
        return []
    median = statistics.median(g for _, g in gaps)
    marks = []
    for index, gap in gaps:
        if median <= 0 or gap < SPIKE_FACTOR * median:
            continue
        start, end = chunk_times_ms[index - 1], chunk_times_ms[index]
        marks.append(SpikeMark(index, gap, median, _batch_change(samples, start, end)))
    return marks


def _batch_change(samples: Sequence[BatchSample], start: float, end: float) -> str:
    before = next((s for s in reversed(samples) if s.t_ms <= start), None)
    # The polls that answered during the gap, up to the first one after its end: gauges by their
    # peak (a queue may fill and drain within the gap), counters by where they stood after it.
    window = []
    for sample in samples:
        if sample.t_ms > start:
            window.append(sample)
            if sample.t_ms >= end:
                break
    gaps = [b.t_ms - a.t_ms for a, b in zip(samples, samples[1:], strict=False)]
    interval = statistics.median(gaps) if gaps else 0.0
    # A poll sent within one interval of the gap's end speaks for it, however late it answered
    # (a server busy with a long prompt answers its /metrics late too).
    if before is None or not window or window[-1].t_ms - window[-1].poll_ms > end + interval:
        return "no poll of the batch around it"
    after = window[-1]
    changes = []
    waiting = _peak(s.waiting for s in window)
    if _rose(before.waiting, waiting):
        changes.append(f"waiting rose {before.waiting:.0f}→{waiting:.0f}")
    if _rose(before.preemptions_total, after.preemptions_total):
        n = after.preemptions_total - before.preemptions_total
        changes.append("a preemption" if n == 1 else f"{n:.0f} preemptions")
    # Prompt tokens taken in: vLLM counts a prompt in its prefix-cache queries when it schedules it,
    # and in its prompt tokens once prefilled; llama-server in its prompt tokens.
    added = max(_added(before.prompt_tokens_total, after.prompt_tokens_total),
                _added(before.prefix_queries_total, after.prefix_queries_total))
    if added >= LONG_PROMPT_TOKENS:
        changes.append(f"a long prompt arrived (+{added:,.0f} prompt tokens)")
    running = _peak(s.running for s in window)
    if _rose(before.running, running):
        changes.append(f"running rose {before.running:.0f}→{running:.0f}")
    return ", ".join(changes) or "no change in the batch seen"


def _added(a: float | None, b: float | None) -> float:
    return b - a if a is not None and b is not None else 0.0


def _peak(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _rose(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and b > a


def best_split(
    client_ttft_ms: float | None,
    send_unix_ms: float,
    *,
    span: ServerSpan | None = None,
    vllm_metrics: VllmRequestMetrics | None = None,
    llama_prompt_ms: float | None = None,
    progress: Sequence[PromptProgress] = (),
    reqscope_ttft_ms: float | None = None,
    reqscope_queue_ms: float | None = None,
) -> TtftSplit | None:
    """The finest split the server's reports allow: a span on the wall clock first, then durations."""
    if client_ttft_ms is None:
        return None
    candidates = (
        split_from_span(client_ttft_ms, send_unix_ms, span) if span is not None else None,
        split_from_vllm_metrics(client_ttft_ms, vllm_metrics) if vllm_metrics is not None else None,
        split_from_llama(client_ttft_ms, llama_prompt_ms, progress) if llama_prompt_ms is not None else None,
        (split_from_reqscope(client_ttft_ms, reqscope_ttft_ms, reqscope_queue_ms)
         if reqscope_ttft_ms is not None else None),
    )
    return next((split for split in candidates if split is not None), None)
