"""Weight formats side by side (`w`): each format's own figures, and how far its output moved; the
reference kernels' row says what the fast paths' speed costs in arithmetic (the same steps, their
time, their KL against the explorer's engine).

One row per format compared, beside the explorer's own (the baseline row is measured in the same
comparison, in step with the other). KL is the baseline's distribution against the other's at
the same step on the same prefix; "parts" is the first step whose top-1 tokens differ. Under the
table: the newest comparison step by step (· agrees, × differs, with a KL sparkline), what the
kept engine cost, and the formats this machine cannot run. Live only: a trace keeps the run on
screen, not the comparisons made beside it.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.kv.arithmetic import MIB
from reqscope.ui.glyphs import sparkline
from reqscope.ui.panel import Panel
from reqscope.ui.run.formats.agreement import FormatComparison, FormatRun
from reqscope.ui.run.frame import Frame

_ROOMY = 12  # from this height on, the panel says how the figures are made, and how far the newest got
_HEAD = (f"{'format':<10}{'tok/s':>7}{'×':>6}{'TTFT':>9}{'read/step':>11}{'top-1':>9}{'KL mean':>9}{'KL max':>9}"
         f"{'parts':>7}")


class FormatsPanel(Panel):
    """The weight formats compared on the run on screen's tokens."""

    TITLE = "Weight formats"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        shown = frame.formats
        if shown is None:
            return Text("w re-runs this request in another weight format (live runs only)", style="dim")
        newest = shown.comparisons[-1] if shown.comparisons else None
        roomy = height >= _ROOMY
        lines = []
        if roomy:
            lines.append(_line("each format forced on the run on screen's tokens: the same prefix at every step; "
                               "KL(baseline ‖ format) in nats; × = tok/s over the baseline's, run in step", "dim"))
        lines.append(_line(_HEAD, "dim underline"))
        if newest is not None:
            lines.append(_line(_row(newest.baseline, None), "bold"))
        else:
            lines.append(_line(f"{shown.baseline:<10}  (this explorer's engine)", "bold"))
        for c in shown.comparisons:
            lines.append(_line(_row(c.other, c)))
        if shown.loading:
            lines.append(_line(shown.loading + " …", "italic"))
        if shown.error:
            lines.append(_line(f"error: {shown.error}", "bold red"))
        if newest is not None:
            lines += _steps(newest, width, roomy)
            if newest.cost is not None:
                cost = newest.cost
                lines.append(_line(
                    f"{newest.other.format} engine: loaded in {cost.load_ms / 1000:.1f} s, holds "
                    f"{cost.weight_bytes / MIB:.0f} MiB of weights (process RSS {cost.rss_bytes / MIB:.0f} MiB), "
                    "kept until another format loads", "dim"))
        for option in shown.options:
            if not option.runs:
                lines.append(_line(f"{option.format}: not on this machine: {option.why_not}", "dim"))
        hint = "w compares the next format" + (f" (comparing {shown.running} now)" if shown.running else "")
        lines.append(_line(hint, "dim"))
        return Group(*lines[: max(height, 1)])


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _row(run: FormatRun, c: FormatComparison | None) -> str:
    rate = "–" if run.decode_tokens_per_s is None else f"{run.decode_tokens_per_s:.1f}"
    ratio = "–"
    if c is not None and c.baseline.decode_tokens_per_s and run.decode_tokens_per_s:
        ratio = f"{run.decode_tokens_per_s / c.baseline.decode_tokens_per_s:.2f}"
    ttft = "–" if run.ttft_ms is None else f"{run.ttft_ms:.0f} ms"
    read = "–" if run.bytes_per_step is None else f"{run.bytes_per_step / MIB:.0f} MiB"
    if c is None:
        return f"{run.format:<10}{rate:>7}{'1.00':>6}{ttft:>9}{read:>11}{'base':>9}"
    agree = f"{c.agreeing}/{len(c.steps)}"
    mean = "–" if c.mean_kl is None else f"{c.mean_kl:.1e}"
    most = "–" if c.max_kl is None else f"{c.max_kl:.1e}"
    parts = "none" if c.first_parting is None else f"{c.first_parting}"
    running = "" if c.finished else " …"
    return f"{run.format:<10}{rate:>7}{ratio:>6}{ttft:>9}{read:>11}{agree:>9}{mean:>9}{most:>9}{parts:>7}{running}"


def _steps(c: FormatComparison, width: int, roomy: bool) -> list[Text]:
    """The newest comparison step by step, the last steps that fit (and how far it got, when roomy or running)."""
    label = f"{c.other.format} by step "
    room = max(width - len(label) - 2, 8)
    tail = c.steps[-room:]
    marks = "".join("·" if s.agrees else "×" for s in tail)
    done = f"{len(c.steps)}/{c.planned_steps} steps" + ("" if c.finished else " …")
    lines = [
        _line(f"{label}{marks}"),
        _line(f"{'KL':<{len(label)}}{sparkline([s.kl for s in tail], room)}", "dim"),
    ]
    if roomy or not c.finished:
        lines.append(_line(f"{done}; greedy tokens would part at step {c.first_parting}" if c.first_parting
                           is not None else f"{done}; top-1 agrees at every step so far", "dim"))  # fmt: skip
    return lines
