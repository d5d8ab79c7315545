"""The one line on stderr that keeps how an explorer's last request ended, once its screen closes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minengine.engine.metrics import RequestMetrics

if TYPE_CHECKING:  # each launcher loads only its own explorer's view
    from reqscope.ui.endpoint.view import EndpointView
    from reqscope.ui.run.view import RunView


def outcome(view: RunView) -> str:
    """How the run on screen ended, with its headline figures."""
    result = view.result
    if result is None:
        return f"left while running ({len(view.tokens)} tokens generated)"
    if result.error:
        return f"failed: {result.error}"
    return f"{result.finish_reason}: {result.usage.completion_tokens} tokens" + headline(result.metrics)


def endpoint_outcome(view: EndpointView) -> str:
    """How the endpoint request on screen ended, with the client's headline figures."""
    result = view.result
    if result is None:
        return "cancelled" if view.cancelled else f"left while streaming ({len(view.chunks)} chunks)"
    if result.error:
        return f"failed: {result.error}"
    text = f"{result.finish_reason or 'done'}: {result.output_tokens} tokens in {result.chunks} chunks"
    return text + headline(result.metrics) + (" (client clock)" if result.metrics else "")


def headline(m: RequestMetrics | None) -> str:
    """", TTFT …, TPOT …, decode …, E2E …" for an outcome line; empty without metrics."""
    if m is None:
        return ""
    text = f", TTFT {m.ttft_ms:.1f} ms"
    if m.tpot_ms is not None and m.decode_output_tokens_per_second is not None:
        text += f", TPOT {m.tpot_ms:.2f} ms, decode {m.decode_output_tokens_per_second:.2f} tok/s"
    return text + f", E2E {m.e2e_ms:.1f} ms"
