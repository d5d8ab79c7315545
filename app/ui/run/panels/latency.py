"""Running latency: TTFT, ITL and its spread, TPOT, both output rates, E2E, prefill against prompt length,
prefill's compute roofline, and the memory roofline of the latest decode step.

The figures are the engine's: a run held at a step (paused, stepped) has the held time taken
out, and the panel says how much was held and what the wall clock, as a client would have seen
it, reads beside them. The roofline sets what the latest decode step read against this machine's
read ceiling: the time those bytes take at the ceiling, the time the step took, the fraction
reached; with room, what half the weight bytes would allow and where the ceiling came from.
Prefill's roofline sets its FLOPs (per token, and over its time) against the compute ceiling
of the path it ran, and says from how many rows a step compute binds instead of bandwidth,
beside the rows its step ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.roofline import FEWER_BYTES
from minengine.kv.arithmetic import MIB
from reqscope.console.roofline_lines import crossover_rows_text
from reqscope.ui.glyphs import ms, pairs
from reqscope.ui.latency_lines import itl_chart, metric_figures
from reqscope.ui.panel import Panel
from reqscope.ui.run.figures.latency import LatencyFigures, RunTtft, ttft_without_hit
from reqscope.ui.run.figures.roofline import PrefillFigures, RooflineFigures, prefill_figures, roofline_figures
from reqscope.ui.run.frame import Frame

if TYPE_CHECKING:  # numpy, only for a fit given with --service-model
    from minengine.plan.service_model import ServiceModel

_ROOFLINE_ROOMY = 7  # free rows from which the roofline takes three lines and the ITL chart keeps four
_ROOFLINE_TWO = 5  # ... two lines, the chart three


class LatencyPanel(Panel):
    """Label/value pairs, the held time, the prefill figures, then the ITLs as a chart (a sparkline when cramped)."""

    TITLE = "Latency"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        fig = frame.latency
        figures = metric_figures(fig.engine, fig.itl, fig.last_itl_ms)
        lines = pairs(figures, width) + held_lines(fig)
        lines.append(_prefill(fig.prefill_ms, fig.prompt_tokens, fig.reused_tokens))
        prefill = prefill_figures(frame.view, frame.header, frame.replay)
        roofline = roofline_figures(frame.view, frame.header, frame.replay)
        more: list[Text] = []
        if frame.view.prefix_cache is not None and frame.view.prefix_cache.enabled and fig.prompt_tokens:
            more += prefix_cache_ttft(fig, frame.request_id, frame.ttft_history)
        if frame.service_model is not None and fig.prompt_tokens:
            more.append(predicted_prefill(frame.service_model, fig))
        if len(frame.prefill_history) > 1:
            history = " · ".join(f"{n} tok {t:.1f} ms" for n, t in frame.prefill_history[-6:])
            more.append(Text(f"prefill by tokens computed: {history}", style="dim", no_wrap=True, overflow="ellipsis"))
        # Each roofline keeps a line when the panel is cramped: the lines above give way first.
        kept_for_rooflines = (prefill is not None) + (roofline is not None)
        lines += more[: max(height - len(lines) - kept_for_rooflines, 0)]
        if prefill is not None:  # two lines where the decode roofline keeps its own, else the compute line
            free = height - len(lines) - (1 if roofline is not None else 0)
            lines += compute_lines(prefill, width, 2 if free >= _ROOFLINE_TWO else 1)
        if roofline is not None:
            free = height - len(lines)
            wanted = 3 if free >= _ROOFLINE_ROOMY else 2 if free >= _ROOFLINE_TWO else 1
            lines += roofline_lines(roofline)[:wanted]
        clock = " (engine time)" if fig.held_ms > 0 else ""
        lines += itl_chart(fig.itls_ms, width, height - len(lines), clock=clock)
        return Group(*lines[: max(height, 1)])


def compute_lines(fig: PrefillFigures, width: int = 200, room: int = 2) -> list[Text]:
    """Prefill against the compute ceiling: FLOPs a token, achieved FLOP/s, the fraction; then the crossover.

    With `room` for one line only, both in one shorter line where `width` holds it.
    """
    p = fig.roofline
    if room < 2 and p.fraction is not None and p.crossover is not None:
        short = (f"compute    {p.flops_per_token / 1e9:.3g} GF/token · {p.flops_per_s / 1e9:.1f} GF/s = "
                 f"{p.fraction:.0%} · binds from ~{crossover_rows_text(p.crossover)} rows, step {p.rows}")  # fmt: skip
        if len(short) <= width:
            return [Text(short, no_wrap=True, overflow="ellipsis")]
    first = Text(no_wrap=True, overflow="ellipsis")
    first.append("compute    ", style="dim")
    first.append(f"prefill {p.flops_per_token / 1e9:.3g} GFLOP/token, {p.flops_per_s / 1e9:.1f} GFLOP/s", style="bold")
    fraction = p.fraction
    if fraction is None or p.ceiling is None:
        first.append(f" · {fig.ceiling_note}", style="dim")
    else:
        first.append(" = ")
        first.append(f"{fraction:.0%}", style="bold green" if fraction >= 0.4 else "bold yellow")
        first.append(f" of {p.ceiling.flops_per_s / 1e9:.1f} GFLOP/s", style="dim")
    first.append(f" · attention {p.attention_share:.0%} of the FLOPs", style="dim")
    second = Text(no_wrap=True, overflow="ellipsis")
    second.append("crossover  ", style="dim")
    if p.crossover is None:
        second.append(f"this step: {p.rows} rows; where compute binds needs both ceilings", style="dim")
    else:
        binds = crossover_rows_text(p.crossover)
        second.append(f"compute binds from ~{binds} rows a step; this step: {p.rows} rows ", style="bold")
        second.append(f"({p.bound}-bound)", style="dim")
    return [first, second][:room]


def roofline_lines(fig: RooflineFigures) -> list[Text]:
    """The latest step against the ceiling; then the run's fraction and what fewer bytes buy; then the ceiling."""
    first = Text(no_wrap=True, overflow="ellipsis")
    first.append("roofline   ", style="dim")
    first.append(f"step {fig.index + 1} read {fig.read.total / MIB:.1f} MiB", style="bold")
    run = fig.run
    if fig.step is None or run.ceiling is None:
        first.append(f" (weights {run.weight_share:.1%}) · {fig.ceiling_note}", style="dim")
        return [first]
    step, ceiling = fig.step, run.ceiling
    first.append(f": {step.roofline_ms:.1f} ms at {ceiling.bytes_per_s / 1e9:.1f} GB/s, took {step.step_ms:.1f} ms = ")
    first.append(f"{step.fraction:.0%}", style="bold green" if step.fraction >= 0.5 else "bold yellow")
    second = Text(no_wrap=True, overflow="ellipsis")
    second.append("           memory-bound: ", style="dim")
    second.append(f"½ the weight bytes → {run.tokens_per_s_at(FEWER_BYTES):.1f} tok/s", style="bold")
    second.append(f" at the ceiling ({run.tokens_per_s_at():.1f} now) · weights {run.weight_share:.1%} of "
                  f"the bytes · run {run.fraction:.0%}", style="dim")  # fmt: skip
    third = Text(no_wrap=True, overflow="ellipsis", style="dim")
    third.append(f"ceiling    {fig.ceiling_note} · {ceiling.probe} · {ceiling.machine}")
    return [first, second, third]


def held_lines(fig: LatencyFigures) -> list[Text]:
    """When the run was held at a step: how long, and the wall clock's figures beside the engine's."""
    if fig.held_ms <= 0:
        return []
    held = Text(no_wrap=True, overflow="ellipsis")
    held.append("held by you", style="yellow")
    held.append(f" {fig.held_ms / 1000:.2f} s", style="bold yellow")
    held.append(" (paused, stepped): not in the engine's figures above", style="yellow")
    wall = Text(no_wrap=True, overflow="ellipsis", style="dim")
    w = fig.wall
    wall.append("wall clock, as a client saw it: ")
    wall.append(f"last ITL {ms(fig.wall_last_itl_ms)} · ITL max {ms(w.itl.max if w and w.itl else None)} · "
                f"E2E {ms(w.e2e_ms if w else None)} · TTFT {ms(w.ttft_ms if w else None)}")
    return [held, wall]


def _prefill(prefill_ms: float | None, tokens: int | None, reused: int = 0) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("prefill    ", style="dim")
    if prefill_ms is None or not tokens:
        text.append("–")
        return text
    text.append(f"{prefill_ms:.1f} ms", style="bold")
    computed = max(tokens - reused, 1)
    per_s = computed / (prefill_ms / 1000) if prefill_ms > 0 else 0.0
    what = f"{computed} of {tokens} tokens ({reused} cached)" if reused else f"{tokens} prompt tokens"
    text.append(f" for {what} ({prefill_ms / computed:.2f} ms/token, {per_s:.0f} tok/s)")
    return text


def prefix_cache_ttft(fig: LatencyFigures, request_id: str, history: tuple[RunTtft, ...]) -> list[Text]:
    """TTFT with the prefix cache hit, and an earlier run of the same prompt length without one."""
    ttft = fig.engine.ttft_ms if fig.engine is not None else None
    hit = Text(no_wrap=True, overflow="ellipsis")
    if not fig.reused_tokens:
        hit.append("cache      ", style="dim")
        hit.append("no hit", style="bold")
        hit.append(" · r runs this prompt again from the cache", style="dim")
        return [hit]
    hit.append("TTFT hit   ", style="dim")
    hit.append(ms(ttft), style="bold green")
    hit.append(f"  {fig.reused_tokens} of {fig.prompt_tokens} tokens cached")
    miss = Text(no_wrap=True, overflow="ellipsis")
    miss.append("TTFT miss  ", style="dim")
    earlier = ttft_without_hit(history, request_id, fig.prompt_tokens or 0)
    if earlier is None:
        miss.append("–  no earlier run of this length without a hit", style="dim")
        return [hit, miss]
    miss.append(ms(earlier.ttft_ms), style="bold")
    miss.append("  the earlier run")
    if ttft:
        miss.append(f", {earlier.ttft_ms / ttft:.1f}× the hit's", style="dim")
    return [hit, miss]


def predicted_prefill(service: ServiceModel, fig: LatencyFigures) -> Text:
    """The calibrated fit's prefill for the tokens this run computed, beside the measured one."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append("fit        ", style="dim")
    computed = fig.computed_tokens or 0
    text.append(f"predicted prefill {service.ttft_ms(computed):.1f} ms (fit)", style="bold")
    text.append(f" vs measured {ms(fig.prefill_ms)}")
    text.append(f" for {computed} tokens", style="dim")
    return text
