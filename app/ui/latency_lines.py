"""The latency lines both explorers' latency panels draw: the headline figures and the ITL chart."""

from __future__ import annotations

from rich.text import Text

from minengine.engine.metrics import ItlStats, RequestMetrics
from reqscope.ui.glyphs import columns, ms, rate, sparkline

_CHART_MAX_ROWS = 10


def metric_figures(m: RequestMetrics | None, itl: ItlStats | None, last_itl_ms: float | None) -> list[tuple[str, str]]:
    """The headline latency figures as label/value pairs, an en dash where not known yet."""
    return [
        ("TTFT", ms(m.ttft_ms if m else None)),
        ("E2E", ms(m.e2e_ms if m else None)),
        ("last ITL", ms(last_itl_ms)),
        ("TPOT", ms(m.tpot_ms if m else None, 2)),
        ("ITL mean", ms(itl.mean if itl else None, 2)),
        ("ITL median", ms(itl.median if itl else None, 2)),
        ("ITL p95", ms(itl.p95 if itl else None, 2)),
        ("ITL max", ms(itl.max if itl else None, 2)),
        ("decode", rate(m.decode_output_tokens_per_second if m else None)),
        ("whole req.", rate(m.whole_request_output_tokens_per_second if m else None)),
    ]


def itl_chart(itls: tuple[float, ...], width: int, rows: int, unit: str = "tokens", clock: str = "") -> list[Text]:
    """The last ITLs as bars scaled to their maximum, with a caption; one sparkline line when cramped.

    `clock` names the clock in the caption when it matters (" (engine time)").
    """
    if rows < 2:
        return []
    tail = itls[-(width - 1) :]
    caption = Text(no_wrap=True, overflow="ellipsis", style="dim")
    if not tail:
        caption.append(f"ITL chart: from the second streamed {unit[:-1]} on")
        return [caption]
    caption.append(f"ITL{clock} of the last {len(tail)} {unit}: {min(tail):.1f}–{max(tail):.1f} ms")
    if rows < 4:
        return [Text(sparkline(tail, width), style="cyan", no_wrap=True), caption]
    top = max(tail)
    each = max(1, min(3, width // len(tail)))
    chart = columns([v / top for v in tail], min(rows - 1, _CHART_MAX_ROWS), each)
    return [Text(line, style="cyan", no_wrap=True) for line in chart] + [caption]
