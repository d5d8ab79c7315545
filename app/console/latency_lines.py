"""The TTFT, TPOT, ITL and E2E lines of both plain summaries: the local run's and the endpoint client's.

The local run's figures come from the engine's token events. The endpoint client's come from the
chunks it received, so its lines say so: the clock they are on, ITL per chunk, and the tokens a
chunk carried when that makes ITL and TPOT differ. The decode-only rate the local summary gives
on its `decode` line, the client's gives on its E2E line (it has no decode stage to show).
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.metrics import RequestMetrics


@dataclass(frozen=True)
class ChunkStream:
    """What a client saw of the answer besides its times: the chunks and the output tokens they carried."""

    chunks: int
    output_tokens: int


def latency_lines(m: RequestMetrics, client: ChunkStream | None = None) -> list[str]:
    """One line each for TTFT, TPOT and ITL (those two when measured) and E2E.

    `client` None: the engine's figures. Given, the figures are a client's, measured per chunk.
    """
    lines = [f"TTFT      {m.ttft_ms:9.2f} ms" + (" (client clock, from send)" if client is not None else "")]
    if m.tpot_ms is not None:
        after_first = f" ({m.output_tokens - 1} tokens after the first)" if client is not None else ""
        lines.append(f"TPOT      {m.tpot_ms:9.2f} ms/token{after_first}")
    if m.itl is not None:
        i = m.itl
        per, gaps = ("per chunk: ", f" ({i.count} gaps)") if client is not None else ("", "")
        lines.append(
            f"ITL       {per}mean {i.mean:.2f}  median {i.median:.2f}  p90 {i.p90:.2f}  "
            f"p99 {i.p99:.2f}  max {i.max:.2f} ms{gaps}"
        )
    if client is not None and client.chunks and client.output_tokens > client.chunks:
        lines.append(
            f"          chunks carry {client.output_tokens / client.chunks:.2f} tokens on average, so ITL (per chunk) "
            "and TPOT (per token) differ"
        )
    rates = f"{m.whole_request_output_tokens_per_second or 0:.2f} tokens/s whole request"
    if client is not None and m.decode_output_tokens_per_second is not None:
        rates += f", {m.decode_output_tokens_per_second:.2f} tokens/s decode-only"
    lines.append(f"E2E       {m.e2e_ms:9.2f} ms   ({rates})")
    return lines
