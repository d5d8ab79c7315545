"""Client-observed latency: TTFT, ITL per chunk, TPOT per token, rates, E2E, and the server's view beside it.

The server's view is whatever it reports: `reqscope serve`'s stage times (TTFT split into
gateway, queue and prefill) or llama.cpp's `timings` (prompt and generation times). When the
request asked for logprobs, a line says what that cost, measured against the newest request of
the session sent without them.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from reqscope.endpoint.events import EndpointResult
from reqscope.endpoint.server.records import VLLM, ServerView
from reqscope.endpoint.server.sglang import meta_info_line
from reqscope.endpoint.settings import LOGPROBS_COST_NOTE
from reqscope.ui.endpoint.frame import Baseline, EndpointFrame
from reqscope.ui.endpoint.ttft_bar import ttft_bar
from reqscope.ui.glyphs import ms, pairs, rate
from reqscope.ui.latency_lines import itl_chart, metric_figures
from reqscope.ui.panel import Panel


class EndpointLatencyPanel(Panel[EndpointFrame]):
    """The client's figures, the logprobs' cost when asked for, the server's view beside the client's, the ITL chart."""

    TITLE = "Latency (client clock)"
    WAITING = "sending…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        view = frame.view
        m = view.metrics()
        itl = m.itl if m is not None else None
        gaps = view.itls_ms()
        figures = metric_figures(m, itl, gaps[-1] if gaps else None)
        tokens, source = view.output_tokens()
        note = Text(no_wrap=True, overflow="ellipsis", style="dim")
        note.append(f"ITL per chunk ({len(view.chunks)}), TPOT per token ({tokens}, from {source})")
        lines = [*pairs(figures, width), note]
        if frame.settings.logprobs:
            lines.append(Text(logprobs_cost_text(m.tpot_ms if m else None, frame.baseline), style="bold yellow",
                              no_wrap=True, overflow="ellipsis"))
        if view.progress:  # llama-server's progress through the prompt, live while it runs
            last = view.progress[-1]
            lines.append(Text(f"prompt progress: {last.processed}/{last.total} tokens ({last.cache} from its cache) "
                              f"in {last.time_ms:.1f} ms, {len(view.progress)} updates (llama-server)",
                              no_wrap=True, overflow="ellipsis"))
        if _span_pending(frame):  # before the server's lines, where a short panel still shows it
            lines.append(_dim("vLLM's span: waiting for it (vLLM exports spans every few seconds)"))
        lines += _server_lines(view.result, width)
        lines += itl_chart(tuple(gaps), width, height - len(lines), unit="chunks")
        return Group(*lines[: max(height, 1)])


def logprobs_cost_text(tpot_ms: float | None, baseline: Baseline | None) -> str:
    """What asking for logprobs cost this request: its TPOT against the newest request of the session without them."""
    head = f"logprobs on: {LOGPROBS_COST_NOTE}"
    if baseline is None:
        return f"{head}; no request without them this session to compare (o, blank logprobs, then r)"
    if tpot_ms is None:
        return f"{head}; TPOT without them {baseline.tpot_ms:.2f} ms (#{baseline.number}), with them: not yet known"
    change = f" ({tpot_ms / baseline.tpot_ms:.2f}x)" if baseline.tpot_ms > 0 else ""
    return (f"logprobs cost: TPOT {tpot_ms:.2f} ms with them vs {baseline.tpot_ms:.2f} ms without "
            f"(#{baseline.number}): {tpot_ms - baseline.tpot_ms:+.2f} ms/token{change}")


def _dim(text: str) -> Text:
    return Text(text, style="dim", no_wrap=True, overflow="ellipsis")


def _heading(text: str) -> Text:
    return Text(text, style="dim underline", no_wrap=True, overflow="ellipsis")


def _server_lines(result: EndpointResult | None, width: int) -> list[Text]:
    """The server's view: TTFT as one bar split by the server's figures, vLLM's metrics and span,
    reqscope serve's stages, llama.cpp's timings, TPOT on both clocks, and the views that were off."""
    if result is None:
        return [_dim("server's view: once the stream ends (vLLM, llama.cpp's server and reqscope serve report one)")]
    view = result.server_view
    lines = []
    if view is not None and view.ttft_split is not None:
        lines += ttft_bar(view.ttft_split, width)
    if view is not None:
        lines += _vllm_lines(view, width)
        if view.sglang_meta is not None:
            lines.append(_dim(meta_info_line(view.sglang_meta)))
    if result.server is None and result.timings is None and (view is None or view.ttft_split is None):
        why = "the server sent no timing report (vLLM, llama.cpp's server and reqscope serve can send one)"
        lines.append(_dim(f"server's view: {why}"))
    if view is not None:
        lines += [Text(o.line(), style="yellow", no_wrap=True, overflow="ellipsis") for o in view.off
                  if o.flag not in ("--metrics", "--no-slots")]
    if result.server is None and result.timings is None:
        return lines
    t = result.ttft
    if t is not None:
        figures = [
            ("client", ms(t.client_ms)),
            ("server", ms(t.server_ms)),
            ("outside", ms(t.outside_server_ms)),
            ("gateway", ms(t.gateway_ms)),
            ("queue", ms(t.queue_ms)),
            ("prefill", ms(t.prefill_ms)),
        ]
        lines += [_heading("TTFT: client clock vs server clock"), *pairs(figures, width),
                  _dim("outside the server: connection, network, HTTP (the client's clock only)")]
    elif result.server is not None:
        lines.append(_dim("server's view: no first token to compare TTFT"))
    if result.timings is not None:
        lines += _timings_lines(result, width)
    if result.tpot is not None:
        c = result.tpot
        figures = [("client", ms(c.client_ms, 2)), ("server", ms(c.server_ms, 2)),
                   ("outside", ms(c.outside_server_ms, 2))]
        lines += [_heading("TPOT: client clock vs server clock"), *pairs(figures, width),
                  _dim("outside its decode: streaming each chunk, the network, the client's reading")]
    return lines


def _span_pending(frame: EndpointFrame) -> bool:
    """A receiver listens, the server is vLLM, the stream has ended well, and its span has not come yet."""
    view = frame.view.server
    if not frame.otlp_listen or view is None or view.kind.name != VLLM or view.span is not None:
        return False
    gave_up = any(o.flag == "--otlp-traces-endpoint" for o in view.off)
    return not gave_up and frame.view.error is None


def _vllm_lines(view: ServerView, width: int) -> list[Text]:
    """vLLM's per-request metrics and its span, on its clock."""
    lines = []
    m = view.vllm_metrics
    if m is not None:
        figures = [("queue", ms(m.queue_time_ms)), ("TTFT sched", ms(m.time_to_first_token_ms)),
                   ("generation", ms(m.generation_time_ms)), ("mean ITL", ms(m.mean_itl_ms, 2)),
                   ("decode", rate(m.tokens_per_second))]
        lines += [_heading("server's view: vLLM per-request metrics (server clock)"), *pairs(figures, width)]
    s = view.span
    if s is not None:
        figures = [("queue", ms(s.queue_ms)), ("prefill", ms(s.prefill_ms)), ("decode", ms(s.decode_ms)),
                   ("inference", ms(s.inference_ms)), ("e2e", ms(s.e2e_ms))]
        lines += [_heading("server's view: vLLM span llm_request (OTLP)"), *pairs(figures, width)]
    return lines


def _timings_lines(result: EndpointResult, width: int) -> list[Text]:
    """llama.cpp's timings: prompt processing and generation on the server's clock."""
    tm = result.timings
    assert tm is not None
    prompt = "–" if tm.prompt_n is None else f"{tm.prompt_n}" + (f" (+{tm.cache_n} cached)" if tm.cache_n else "")
    figures = [
        ("prompt", ms(tm.prompt_ms)),
        ("prompt tok", prompt),
        ("generation", ms(tm.predicted_ms)),
        ("generated", "–" if tm.predicted_n is None else str(tm.predicted_n)),
        ("per token", ms(tm.predicted_per_token_ms, 2)),
        ("decode", rate(tm.predicted_per_second)),
    ]
    lines = [_heading("server's view: llama.cpp timings (server clock)"), *pairs(figures, width)]
    m = result.metrics
    if m is not None and tm.prompt_ms is not None:
        lines.append(_dim(f"client TTFT {m.ttft_ms:.1f} ms: {m.ttft_ms - tm.prompt_ms:.1f} ms beyond its prompt time "
                          "(queue, tokenizing, network, HTTP)"))
    return lines
