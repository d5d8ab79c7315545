"""Running latency: TTFT, ITL and its spread, TPOT, both output rates, E2E, prefill against prompt length."""

from __future__ import annotations

from reqscope.ui.frame import Frame
from reqscope.ui.glyphs import ms, rate, sparkline
from reqscope.ui.latency import latency_figures
from reqscope.ui.panel import Panel
from rich.console import Group, RenderableType
from rich.text import Text


class LatencyPanel(Panel):
    """Label/value pairs, the ITL sparkline, and the prefill figures."""

    TITLE = "Latency"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        fig = latency_figures(frame.view)
        m, itl = fig.metrics, fig.itl
        pairs = [
            ("TTFT", ms(m.ttft_ms if m else None)),
            ("E2E", ms(m.e2e_ms if m else None)),
            ("last ITL", ms(fig.last_itl_ms)),
            ("TPOT", ms(m.tpot_ms if m else None, 2)),
            ("ITL mean", ms(itl.mean if itl else None, 2)),
            ("ITL median", ms(itl.median if itl else None, 2)),
            ("ITL p95", ms(itl.p95 if itl else None, 2)),
            ("ITL max", ms(itl.max if itl else None, 2)),
            ("decode", rate(m.decode_output_tokens_per_second if m else None)),
            ("whole req.", rate(m.whole_request_output_tokens_per_second if m else None)),
        ]
        lines = _pairs(pairs, width)
        spark_width = max(width - 5, 1)
        spark = Text(no_wrap=True)
        spark.append("ITL ", style="dim")
        spark.append(sparkline(fig.itls_ms, spark_width), style="cyan")
        lines.append(spark)
        if fig.itls_ms:
            tail = fig.itls_ms[-spark_width:]
            lines.append(Text(f"    {min(tail):.1f}–{max(tail):.1f} ms over the last {len(tail)} gaps", style="dim", no_wrap=True))
        lines.append(_prefill(fig.prefill_ms, fig.prompt_tokens))
        if len(frame.prefill_history) > 1:
            history = " · ".join(f"{n} tok {t:.1f} ms" for n, t in frame.prefill_history[-6:])
            lines.append(Text(f"prefill by prompt length: {history}", style="dim", no_wrap=True, overflow="ellipsis"))
        return Group(*lines[: max(height, 1)])


def _pairs(pairs: list[tuple[str, str]], width: int) -> list[Text]:
    per_line = 2 if width >= 44 else 1
    cell = width // per_line
    lines = []
    for start in range(0, len(pairs), per_line):
        line = Text(no_wrap=True)
        for label, value in pairs[start : start + per_line]:
            line.append(f"{label:<11}", style="dim")
            line.append(value.ljust(cell - 11), style="bold")
        lines.append(line)
    return lines


def _prefill(prefill_ms: float | None, tokens: int | None) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("prefill    ", style="dim")
    if prefill_ms is None or not tokens:
        text.append("–")
        return text
    text.append(f"{prefill_ms:.1f} ms", style="bold")
    per_s = tokens / (prefill_ms / 1000) if prefill_ms > 0 else 0.0
    text.append(f" for {tokens} prompt tokens ({prefill_ms / tokens:.2f} ms/token, {per_s:.0f} tok/s)")
    return text
