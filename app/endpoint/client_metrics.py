"""Client-side request metrics from chunk arrival times, keeping ITL and TPOT apart.

A streamed chunk may carry several tokens (a server batching its writes, speculative
decoding, or a detokenizer holding back half a character). ITL is measured per chunk: every
gap between consecutive chunk arrivals. TPOT is per token: (E2E - TTFT) / (O - 1), with O the
output token count. O comes from the server's `usage` when it reports one, else from the
logprob entries (one per token), else the chunk count stands in for it, which assumes one
token per chunk. When every chunk carries one token, TPOT equals the mean ITL; otherwise the
two diverge and both are reported.
"""

from __future__ import annotations

from collections.abc import Sequence

from minengine.engine.events import Usage
from minengine.engine.metrics import RequestMetrics, request_metrics
from reqscope.endpoint.events import DecodeComparison, ServerReport, ServerTimings, TtftComparison


def output_token_count(usage: Usage | None, logprob_tokens: int, chunks: int) -> tuple[int, str]:
    """O and where it came from: "usage", "logprobs" or "chunks".

    A count smaller than the chunks seen cannot be right (each chunk holds at least one
    token), so it falls through to the next source.
    """
    if usage is not None and usage.completion_tokens >= max(chunks, 1):
        return usage.completion_tokens, "usage"
    if logprob_tokens >= max(chunks, 1):
        return logprob_tokens, "logprobs"
    return chunks, "chunks"


def client_metrics(chunk_times_ms: Sequence[float], output_tokens: int, send_ms: float = 0.0) -> RequestMetrics | None:
    """Metrics from the arrival time of every chunk of visible text; None when none arrived."""
    if not chunk_times_ms:
        return None
    first, last = chunk_times_ms[0], chunk_times_ms[-1]
    if len(chunk_times_ms) == 1 and output_tokens > 1:
        # All tokens arrived at once: TTFT and E2E coincide and no per-token time exists.
        ttft = first - send_ms
        return RequestMetrics(
            ttft_ms=ttft,
            e2e_ms=ttft,
            tpot_ms=None,
            decode_output_tokens_per_second=None,
            whole_request_output_tokens_per_second=output_tokens / (ttft / 1000) if ttft > 0 else None,
            itl=None,
            output_tokens=output_tokens,
        )
    return request_metrics(
        send_ms=send_ms,
        first_ms=first,
        last_ms=last,
        output_tokens=output_tokens,
        token_times_ms=chunk_times_ms,
    )


def compare_ttft(metrics: RequestMetrics | None, server: ServerReport | None) -> TtftComparison | None:
    """Client TTFT beside the server's, when both exist."""
    if metrics is None or server is None or server.ttft_ms is None:
        return None
    return TtftComparison(
        client_ms=metrics.ttft_ms,
        server_ms=server.ttft_ms,
        gateway_ms=server.stage_ms("gateway"),
        queue_ms=server.queue_ms,
        prefill_ms=server.stage_ms("prefill"),
    )


def compare_tpot(
    metrics: RequestMetrics | None, server: ServerReport | None, timings: ServerTimings | None
) -> DecodeComparison | None:
    """Client TPOT beside the server's own time per output token, from whichever report it sent."""
    if metrics is None or metrics.tpot_ms is None:
        return None
    if server is not None and server.tpot_ms is not None:
        return DecodeComparison(metrics.tpot_ms, server.tpot_ms, "reqscope")
    if timings is not None and timings.predicted_per_token_ms is not None:
        return DecodeComparison(metrics.tpot_ms, timings.predicted_per_token_ms, "timings")
    return None


def prompt_count(usage: Usage) -> str:
    """The prompt's token count as the server reported it, with the prefix cache's share when any."""
    cached = f" ({usage.cached_tokens} cached)" if usage.cached_tokens else ""
    return f"{usage.prompt_tokens}{cached}"
