"""The readout: one line under the pipeline, on screen at every size, with the figures the tool exists for.

Tokens out, TTFT, the last ITL and the ITL median, the decode rate, KV logical/physical MiB and
the cache layout, once the run has been held at a step, the time held, and, while other
requests share its steps, the sequences in its latest step and the queue. The figures are
the engine's (held time taken out, see `reqscope.ui.run.figures.latency`), the same the latency panel
shows. Each item has a few spellings, longest first; the line takes the longest that fit, so
at 80 columns it says the same in fewer letters.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import RenderableType
from rich.text import Text

from minengine.kv.arithmetic import MIB
from minengine.kv.usage import KVUsage
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.view import RunView

_SEPARATORS = (" · ", "  ", " ")
# How the line shortens, one step at a time until it fits: ("item", name) takes that item's next
# spelling (a step naming an item not on the line does nothing), ("sep", n) the n-th separator.
# Plain words go before the terse ones (t/s, M).
_PLAN = (("item", "kv"), ("item", "batch"), ("item", "tokens"), ("item", "decode"), ("item", "held"),
         ("item", "itl"), ("item", "p50"), ("item", "ttft"), ("sep", 1), ("item", "tokens"), ("item", "held"),
         ("item", "kv"), ("sep", 2), ("item", "decode"), ("item", "kv"), ("item", "batch"))
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


@dataclass(frozen=True)
class Item:
    """One figure: its spellings, longest first, each a (label, value) pair; and the value's style."""

    name: str  # what the shortening plan calls it
    forms: tuple[tuple[str, str], ...]
    style: str = "bold"
    label_style: str = "dim"


class ReadoutPanel(Panel):
    """One line of running figures, drawn from the frame like every panel."""

    WAITING = ""

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        return fit_line(readout_items(frame), width)


def readout_items(frame: Frame) -> list[Item]:
    """The readout's items for `frame`, in the order they are shown."""
    fig, view = frame.latency, frame.view
    m, itl = fig.engine, fig.itl
    out = len(view.tokens)
    ttft = m.ttft_ms if m else None
    median = itl.median if itl else None
    items = [
        Item("tokens", (("out ", f"{out}/{frame.max_tokens} tok"), ("", f"{out}/{frame.max_tokens} tok"),
                        ("", f"{out} tok"))),
        Item("ttft", (("TTFT ", short_ms(ttft, " ")), ("TTFT ", short_ms(ttft)))),
        Item("itl", (("ITL last ", short_ms(fig.last_itl_ms, " ")), ("ITL ", short_ms(fig.last_itl_ms)))),
        Item("p50", (("p50 ", short_ms(median, " ")), ("p50 ", short_ms(median)))),
        _decode_item(m.decode_output_tokens_per_second if m else None),
        _kv_item(view.kv),
    ]
    if fig.held_ms > 0:
        held = _seconds(fig.held_ms)
        items.append(Item("held", (("held by you ", f"{held} (not in these figures)"), ("held by you ", held),
                                   ("held ", held.replace(" ", ""))), style="bold yellow", label_style="yellow"))
    if view.batched:
        items.append(_batch_item(view))
    return items


def fit_line(items: list[Item], width: int) -> Text:
    """The items on one line `width` wide: the longest spellings and widest separators that fit.

    Past the last step the line is cut with an ellipsis (numbers far larger than usual).
    """
    chosen, sep = [0] * len(items), _SEPARATORS[0]
    index = {item.name: n for n, item in enumerate(items)}
    steps = iter(_PLAN)
    while _length(items, chosen, sep) > width:
        step = next(steps, None)
        if step is None:
            break
        kind, which = step
        if kind == "sep":
            sep = _SEPARATORS[which]
        elif (n := index.get(which)) is not None:
            chosen[n] = min(chosen[n] + 1, len(items[n].forms) - 1)
    return _render(items, chosen, sep)


def _length(items: list[Item], chosen: list[int], sep: str) -> int:
    forms = (item.forms[i] for item, i in zip(items, chosen, strict=True))
    return sum(len(label) + len(value) for label, value in forms) + len(sep) * (len(items) - 1)


def _render(items: list[Item], chosen: list[int], sep: str) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    for n, (item, i) in enumerate(zip(items, chosen, strict=True)):
        if n:
            text.append(sep, style="dim")
        label, value = item.forms[i]
        text.append(label, style=item.label_style)
        text.append(value, style=item.style)
    return text


def _decode_item(rate: float | None) -> Item:
    value = "–" if rate is None else f"{rate:.1f}"
    return Item("decode", (("decode ", f"{value} tok/s"), ("", f"{value} tok/s"), ("", f"{value}t/s")))


def _kv_item(kv: KVUsage | None) -> Item:
    if kv is None:
        return Item("kv", (("KV ", "–"),))
    logical, physical = kv.logical_bytes / MIB, kv.physical_bytes / MIB
    short = f"{_mib(logical)}/{_mib(physical)}"
    dtype = _SHORT_DTYPE.get(kv.dtype, kv.dtype)
    return Item("kv", (
        ("KV ", f"{logical:.3f}/{physical:.3f} MiB logical/physical, {kv.layout} cache {dtype}"),
        ("KV ", f"{short} MiB {kv.layout} {dtype}"),
        ("KV ", f"{short} MiB {kv.layout}"),
        ("KV ", f"{short}M {kv.layout}"),
    ))


def _batch_item(view: RunView) -> Item:
    """The sequences in the request's latest step, and the queue behind it (the batch panel has the rest)."""
    step = next((t.batch for t in reversed(view.tokens) if t.batch is not None), None)
    if step is None and view.prefill is not None and view.prefill.chunks:
        step = view.prefill.chunks[-1].step
    if step is None:
        return Item("batch", (("batch ", "–"),), style="bold magenta")
    n, q = step.sequences, step.waiting
    return Item("batch", (("batch ", f"{n} seqs, {q} queued"), ("batch ", f"{n} q{q}"), ("batch ", f"{n}")),
                style="bold magenta")


def short_ms(value: float | None, space: str = "") -> str:
    """Milliseconds in at most four digits: 36.1 ms, 238 ms, 1.24 s."""
    if value is None:
        return "–"
    if value >= 1000:
        return f"{value / 1000:.2f}{space}s"
    return f"{value:.1f}{space}ms" if value < 100 else f"{value:.0f}{space}ms"


def _seconds(value_ms: float) -> str:
    return f"{value_ms / 1000:.1f} s" if value_ms >= 100 else f"{value_ms:.0f} ms"


def _mib(value: float) -> str:
    """MiB in three significant digits."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"
