"""The server's view in words: the lines the plain mode prints and the explorer's panels reuse.

Each line names where its figures came from, so a reader can tell the client's clock from the
server's and one server route from another.
"""

from __future__ import annotations

from reqscope.endpoint.server.records import BatchSample, ServerView, TtftSplit


def split_parts(split: TtftSplit) -> list[tuple[str, float | None]]:
    """The bar's segments in order, each with its milliseconds (None: the server does not say)."""
    if split.joined:
        return [
            ("outside the server", split.outside_ms),
            ("queue", split.queue_ms),
            ("prefill + first token", split.prefill_first_token_ms),
        ]
    return [
        ("connection + HTTP", split.connection_http_ms),
        ("queue", split.queue_ms),
        ("prefill + first token", split.prefill_first_token_ms),
        ("delivery", split.delivery_ms),
    ]


def split_line(split: TtftSplit) -> str:
    """TTFT as the sum of its parts, in one line, with the source."""
    parts = " + ".join(f"{name} {ms:.1f}" for name, ms in split_parts(split) if ms is not None)
    joined = " (connection, HTTP and delivery together: no shared clock)" if split.joined else ""
    return f"TTFT {split.client_ttft_ms:.1f} ms = {parts} ms, from {split.source}{joined}{api_note(split)}"


def api_note(split: TtftSplit) -> str:
    """Where known, how much of connection and HTTP the server spent before its queue."""
    if split.server_api_ms is None:
        return ""
    return f"; of connection + HTTP, {split.server_api_ms:.1f} ms inside the server before its queue (template, tokens)"


def batch_change(first: BatchSample, last: BatchSample) -> str:
    """How the batch moved from the first poll to the last: gauges as a→b, counters as their increase."""
    parts = []
    for name, a, b in (("running", first.running, last.running), ("waiting", first.waiting, last.waiting)):
        if a is not None and b is not None:
            parts.append(f"{name} {a:.0f}→{b:.0f}")
    if first.kv_usage is not None and last.kv_usage is not None:
        parts.append(f"KV {first.kv_usage:.1%}→{last.kv_usage:.1%}")
    if first.busy_slots_per_decode is not None and last.busy_slots_per_decode is not None:
        parts.append(f"busy slots per decode {last.busy_slots_per_decode:.2f}")
    if first.preemptions_total is not None and last.preemptions_total is not None:
        parts.append(f"preemptions +{last.preemptions_total - first.preemptions_total:.0f}")
    if None not in (first.prefix_queries_total, last.prefix_queries_total, first.prefix_hits_total,
                    last.prefix_hits_total):  # fmt: skip
        queried = last.prefix_queries_total - first.prefix_queries_total
        hit = last.prefix_hits_total - first.prefix_hits_total
        parts.append(f"prefix cache {hit:.0f}/{queried:.0f} tokens hit")
    return ", ".join(parts) or "no figures"


def peaks(samples: tuple[BatchSample, ...]) -> str:
    """The most running and waiting any poll saw."""
    running = [s.running for s in samples if s.running is not None]
    waiting = [s.waiting for s in samples if s.waiting is not None]
    parts = []
    if running:
        parts.append(f"running at most {max(running):.0f}")
    if waiting:
        parts.append(f"waiting at most {max(waiting):.0f}")
    return ", ".join(parts)


def poll_cost(view: ServerView) -> str:
    """What watching the batch cost: how often, how many reads, each one's round trip."""
    if not view.batch:
        return "batch: not read (--poll-ms 0, or the server has no route for it)"
    return (f"polled every {view.poll_interval_ms:.0f} ms: {len(view.batch)} reads, {view.poll_cost_ms:.1f} ms each "
            "on the client's clock, beside the stream")


def batch_lines(view: ServerView) -> list[str]:
    """The batch around the request, from the first poll to the last, and the cost of polling."""
    if not view.batch:
        return [poll_cost(view)]
    first, last = view.batch[0], view.batch[-1]
    peak = peaks(view.batch)
    return [f"{batch_change(first, last)}{'; ' + peak if peak else ''} ({last.source})", poll_cost(view)]


def prompt_line(view: ServerView, usage_prompt_tokens: int | None) -> str:
    """The tokens the server's template made, checked against the usage the request reported."""
    prompt = view.prompt
    if prompt is None:
        return f"server's tokens: not read ({view.prompt_error})" if view.prompt_error else ""
    count = len(prompt.token_ids)
    if usage_prompt_tokens is None:
        check = "no usage to check against"
    elif usage_prompt_tokens == count:
        check = f"= usage.prompt_tokens {usage_prompt_tokens} ✓"
    else:
        check = f"≠ usage.prompt_tokens {usage_prompt_tokens}: the server counted differently"
    ids = view.prompt_token_ids
    same = "" if ids is None else (", the same ids the request returned" if tuple(ids) == prompt.token_ids
                                   else ", not the ids the request returned")
    return f"{count} tokens by the server's template {check}{same} ({prompt.source})"
