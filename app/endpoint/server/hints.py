"""For each view a server could give about a request but did not: one line naming the flag that turns it on."""

from __future__ import annotations

from reqscope.endpoint.server.records import LLAMA_SERVER, VLLM, OffView, ServerView

OTLP_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf"


def off_views(
    view: ServerView,
    *,
    cached_reported: bool,
    otlp_listen: str | None,
    span_wait_s: float | None = None,
    metrics_off: bool = False,
    slots_off: bool = False,
) -> tuple[OffView, ...]:
    """The views `view.kind` offers that this request went without.

    `cached_reported`: the usage carried `prompt_tokens_details`; `otlp_listen`: the receiver's
    HOST:PORT when one listened; `span_wait_s`: how long it waited in vain for the span (None
    while it has not waited yet); `metrics_off`/`slots_off`: those routes answered that the flag
    is off.
    """
    off: list[OffView] = []
    if view.kind.name == VLLM:
        if view.vllm_metrics is None:
            off.append(OffView("vLLM's timing of this request (queue, TTFT, decode)", "--enable-per-request-metrics",
                               "start vLLM with --enable-per-request-metrics"))
        if otlp_listen is None:
            off.append(OffView("vLLM's trace span (queue, prefill, decode on its clock)", "--otlp-traces-endpoint",
                               "run reqscope with --otlp-listen 127.0.0.1:4318 and vLLM with "
                               f"--otlp-traces-endpoint http://127.0.0.1:4318/v1/traces and {OTLP_ENV}"))
        elif view.span is None and span_wait_s is not None:
            off.append(OffView(f"vLLM's trace span (none arrived in {span_wait_s:.0f} s)", "--otlp-traces-endpoint",
                               f"start vLLM with --otlp-traces-endpoint http://{otlp_listen}/v1/traces and {OTLP_ENV}"))
        if not cached_reported:
            off.append(OffView("cached prompt tokens", "--enable-prompt-tokens-details",
                               "start vLLM with --enable-prompt-tokens-details"))
    if view.kind.name == LLAMA_SERVER:
        if metrics_off:
            off.append(OffView("the batch (requests processing, deferred)", "--metrics",
                               "start llama-server with --metrics"))
        if slots_off:
            # /slots is on by default in llama-server: only --no-slots turns it off.
            off.append(OffView("the slots (each one's task and tokens)", "--no-slots",
                               "start llama-server without --no-slots"))
    return tuple(off)
