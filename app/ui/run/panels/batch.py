"""The request inside the batch: who shared its step, what the step scheduled and cost, the KV pool, the queue.

Drawn only for a request that shares the engine (other sequences in its steps, a prompt
prefilled in chunks, a preemption) or an explorer that puts load on it (`--background`,
`--serve-port`); a request alone reads as it always did, without this panel. Lines, in the
order they give way to a short panel: the load on the engine, the step on screen, its time
against a step of one sequence alone, the pool as a bar and its legend, the prompt's chunks,
the preemptions, the run so far, then the batch size and the step time over the recent steps.
"""

from __future__ import annotations

from dataclasses import replace

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.batch_facts import BatchStep, PrefillChunk
from minengine.kv.arithmetic import MIB
from minengine.kv.usage import PoolUsage
from reqscope.engine_load import LoadNote
from reqscope.ui.glyphs import columns, sparkline
from reqscope.ui.panel import Panel
from reqscope.ui.run.figures.batch import BatchFigures, batch_figures
from reqscope.ui.run.frame import Frame

# The pool's parts: (name, glyph, style), in the order the bar draws them. Each part has a
# glyph of its own, so the bar reads without colour too.
POOL_PARTS = (("this request", "█", "bold green"), ("others", "▓", "yellow"), ("prefix cache", "▒", "blue"),
              ("free", "░", "dim"))  # fmt: skip
_CHART_MIN_ROWS = 4  # a caption and three rows of columns; fewer rows get a sparkline
_CHART_MAX_ROWS = 8
_SHOWN_PREEMPTIONS = 2
_ZOOM_BELOW = 0.2  # a pool held less than this shows its held part again, as a bar of its own (with room)
_ZOOM_FROM_ROWS = 14


class BatchPanel(Panel):
    """The step on screen among the others, the pool, the chunks and preemptions, the recent steps."""

    TITLE = "Batch"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        fig = batch_figures(frame.view)
        lines = [] if frame.load is None else [load_line(frame.load)]
        if fig.step is None:
            lines.append(_line("the batch appears with the request's first engine step", "dim"))
            return Group(*lines[:height])
        pool = fig.step.pool
        lines += [step_line(fig.step, fig.label, width), time_line(fig), pool_bar(pool, width)]
        if height >= _ZOOM_FROM_ROWS and 0 < pool.budget - pool.free < _ZOOM_BELOW * pool.budget:
            lines.append(held_bar(pool, width))
        lines += [pool_legend(pool, width), chunks_line(fig.chunks)]
        lines += preemption_lines(fig)
        lines.append(summary_line(fig, frame.view.done))
        lines += recent_chart(fig.recent, width, height - len(lines))
        return Group(*lines[: max(height, 1)])


def _line(text: str = "", style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def load_line(load: LoadNote) -> Text:
    """What else the explorer runs in its engine: the background requests and the served API."""
    text = _line()
    text.append("engine shared", style="bold")
    if load.background:
        text.append(f" with {load.background} background request{'s' if load.background != 1 else ''}")
    if load.serve_url:
        text.append(" · " if load.background else " with clients of ")
        text.append(f"the OpenAI API at {load.serve_url}/v1", style="bold cyan")
    return text


def step_line(step: BatchStep, label: str, width: int) -> Text:
    """The step on screen: how many sequences shared it, what it scheduled, the queue behind it."""
    others = step.sequences - 1
    company = f" ({others} other{'s' if others != 1 else ''})" if others else " (alone)"
    wordings = (
        (f"step {step.step} ({label}): ", f"{step.sequences} sequences", company,
         f" · {step.decode_tokens} decode + {step.prefill_tokens} prefill tokens", " · queue "),
        (f"step {step.step}: ", f"{step.sequences} sequences", "",
         f" · {step.decode_tokens} decode + {step.prefill_tokens} prefill tok", " · queue "),
        (f"step {step.step}: ", f"{step.sequences} seq", "", f" · {step.decode_tokens}+{step.prefill_tokens} tok",
         " · queue "),
    )  # fmt: skip
    # The path the step's arithmetic took (`minengine.steps.step_path`), said while it fits.
    paths = (f" · {step.path}", "") if step.path else ("",)
    for where, sequences, company_text, scheduled, queue in wordings:
        for path in paths:
            text = _line()
            text.append(where, style="dim")
            text.append(sequences, style="bold")
            text.append(company_text, style="dim")
            text.append(scheduled)
            text.append(queue, style="dim")
            text.append(f"{step.waiting}", style="bold yellow" if step.waiting else "bold")
            text.append(path, style="cyan")
            if text.cell_len <= width:
                return text
    return text


def time_line(fig: BatchFigures) -> Text:
    """The step's time, against a step of one sequence alone on this engine, and per sequence."""
    step = fig.step
    assert step is not None
    text = _line()
    text.append("step time ", style="dim")
    text.append(f"{step.step_ms:.1f} ms", style="bold")
    slowdown = fig.slowdown
    if slowdown is None:
        text.append(" · alone: not measured yet", style="dim")
    else:
        text.append(f" · alone {step.solo_step_ms:.1f} ms → ")
        text.append(f"{slowdown:.2f}×", style="bold yellow" if slowdown >= 1.5 else "bold")
    if step.sequences > 1:
        text.append(f" · {step.step_ms / step.sequences:.1f} ms per sequence", style="dim")
    return text


def pool_parts(pool: PoolUsage) -> tuple[int, int, int, int]:
    """The pool's bytes in bar order: this request's, the others', the prefix cache's, free."""
    return pool.own, pool.others, pool.prefix, pool.free


def pool_cells(pool: PoolUsage, width: int) -> list[int]:
    """Cells of a bar `width` wide for each part: proportional, a held part never shown as none."""
    parts = pool_parts(pool)
    total = max(sum(parts), 1)
    cells = [max(round(p / total * width), 1 if p else 0) for p in parts]
    while sum(cells) > width:  # the minimum cells pushed it over: take them from the largest part
        cells[cells.index(max(cells))] -= 1
    cells[3] += width - sum(cells)  # rounding's remainder is free space
    return cells


def pool_bar(pool: PoolUsage, width: int) -> Text:
    """The KV pool as one bar: this request's blocks, the other requests', the prefix cache's, free."""
    used = pool.own + pool.others + pool.prefix
    return _bar("pool ", pool, f" {used / MIB:.1f}/{pool.budget / MIB:.0f} MiB", width)


def held_bar(pool: PoolUsage, width: int) -> Text:
    """The pool's held part alone, as a bar of its own: who holds it, when the whole pool's bar is mostly free."""
    held = replace(pool, budget=pool.own + pool.others + pool.prefix)
    return _bar("held ", held, f" {held.budget / pool.budget:.1%} of it", width)


def _bar(label: str, pool: PoolUsage, figure: str, width: int) -> Text:
    text = _line()
    text.append(label, style="dim")
    for (_, glyph, style), cells in zip(POOL_PARTS, pool_cells(pool, max(width - len(label) - len(figure), 1)),
                                        strict=True):  # fmt: skip
        text.append(glyph * cells, style=style)
    text.append(figure)
    return text


def pool_legend(pool: PoolUsage, width: int) -> Text:
    """Each part of the bar, its glyph and its MiB; names shortened when narrow."""
    for short in (False, True):
        text = _line()
        for (name, glyph, style), nbytes in zip(POOL_PARTS, pool_parts(pool), strict=True):
            if text.plain:
                text.append("  ")
            text.append(glyph, style=style)
            shown = {"this request": "this", "prefix cache": "prefix"}.get(name, name) if short else name
            text.append(f" {shown} {nbytes / MIB:.2f} MiB")
        if text.cell_len <= width:
            break
    return text


def chunks_line(chunks: tuple[PrefillChunk, ...]) -> Text:
    """The prompt's prefill chunks: the positions each covered, and the sequences its step ran."""
    text = _line()
    text.append("prefill ", style="dim")
    if not chunks:
        text.append("–", style="dim")
        return text
    text.append(f"{len(chunks)} chunk{'s' if len(chunks) != 1 else ''}", style="bold")
    shown = " · ".join(f"{c.start}–{c.start + c.tokens - 1} in step {c.step.step} ({c.step.sequences} seq)"
                       for c in chunks[:4])  # fmt: skip
    more = f" · {len(chunks) - 4} more" if len(chunks) > 4 else ""
    text.append(f": {shown}{more}")
    return text


def preemption_lines(fig: BatchFigures) -> list[Text]:
    """One line per recent preemption: when, why, what it freed and what must be recomputed."""
    if not fig.preemptions:
        return [_line("preempted never", "dim")]
    lines = []
    for after, event in fig.preemptions[-_SHOWN_PREEMPTIONS:]:
        text = _line()
        text.append("preempted ", style="bold red")
        text.append(f"after token {after} ({event.t_ms / 1000:.2f} s): {event.blocks_freed} blocks, "
                    f"{event.bytes_freed / MIB:.2f} MiB freed, {event.tokens_to_recompute} tokens to recompute")
        text.append(f" · {event.reason}", style="dim")  # fmt: skip
        lines.append(text)
    if len(fig.preemptions) > _SHOWN_PREEMPTIONS:
        lines[0].append(f" ({len(fig.preemptions)} in all)", style="dim")
    return lines


def summary_line(fig: BatchFigures, done: bool) -> Text:
    """The request's steps: how many, how many shared, the batch's mean and largest size."""
    s = fig.summary
    text = _line()
    text.append("whole run " if done else "so far ", style="dim")
    text.append(f"{s.steps} steps, {s.shared_steps} shared · batch mean {s.mean_batch:.1f}, max {s.max_batch}")
    return text


def recent_chart(recent: tuple[BatchStep, ...], width: int, rows: int) -> list[Text]:
    """The recent decode steps: sequences per step and, with room, each step's time against one sequence alone.

    Columns with a caption each; a sparkline and its caption when cramped.
    """
    if rows < 2 or not recent:
        return []
    tail = recent[-width:]
    sizes = [s.sequences for s in tail]
    times = [s.step_ms for s in tail]
    solo = next((s.solo_step_ms for s in reversed(tail) if s.solo_step_ms), None)
    size_caption = f"sequences per step, last {len(tail)} decode steps: {min(sizes)}–{max(sizes)}"
    alone = f", alone {solo:.1f} ms" if solo else ""
    time_caption = f"step time, last {len(tail)}: {min(times):.1f}–{max(times):.1f} ms{alone}"
    if rows < _CHART_MIN_ROWS:
        short = f"last {len(tail)} steps: {min(sizes)}–{max(sizes)} sequences, {min(times):.1f}–{max(times):.1f} ms"
        return [Text(sparkline(sizes, width), style="magenta", no_wrap=True),
                _line(short + (f" (alone {solo:.1f})" if solo else ""), "dim")]  # fmt: skip
    each = max(1, min(3, width // len(tail)))
    if rows < 2 * _CHART_MIN_ROWS:
        return _columns(sizes, max(sizes), rows, each, "magenta", size_caption)
    half = rows // 2
    top = max(max(times), solo or 0.0)
    return (_columns(sizes, max(sizes), half, each, "magenta", size_caption)
            + _columns(times, top, rows - half, each, "cyan", time_caption))  # fmt: skip


def _columns(values: list[float] | list[int], top: float, rows: int, each: int, style: str, caption: str) -> list[Text]:
    chart = columns([v / top for v in values], min(rows - 1, _CHART_MAX_ROWS), each)
    return [Text(line, style=style, no_wrap=True) for line in chart] + [_line(caption, "dim")]
