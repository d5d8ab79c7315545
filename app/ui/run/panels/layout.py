"""GQA against MHA and MQA: formula sizes at the current token count, and both layouts measured."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.kv.arithmetic import KIB, MIB
from reqscope.ui.glyphs import ms
from reqscope.ui.panel import Panel
from reqscope.ui.run.figures.layout_compare import MeasuredLayout, formula_rows
from reqscope.ui.run.frame import Frame

_ROOMY = 12  # from this height on, the panel spells out the formula and spaces its sections


class LayoutPanel(Panel):
    """Formula rows, measured rows, and the ratios between them."""

    TITLE = "GQA vs MHA"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        kv = frame.view.kv
        if kv is None:
            return Text("sizes appear once the cache holds the prompt", style="dim")
        h = frame.header
        lines = []
        if height >= _ROOMY:
            formula = f"2 × {h.layers} layers × heads × {h.head_dim} dims × bytes per element"
            lines.append(_line(f"KV bytes per token = {formula}", "dim"))
        lines.append(_line(
            f"{'':<5}{'heads':>6}{'per token':>11}{f'{kv.tokens} tok':>11}{'ratio':>7}", "dim underline"
        ))
        rows = formula_rows(h, kv)
        own = rows[0].bytes_per_token
        for row in rows:
            lines.append(_line(
                f"{row.name:<5}{row.heads:>6}{row.bytes_per_token / KIB:>7.1f} KiB"
                f"{row.bytes_now / MIB:>7.3f} MiB{row.bytes_per_token / own:>6.2f}×",
                "bold" if row is rows[0] else "",
            ))
        if height >= _ROOMY:
            share = h.q_heads // max(h.kv_heads, 1)
            lines.append(Text(f"{h.kv_heads} KV heads, each shared by {share} query heads; MHA keeps one per "
                              f"query head, MQA one for all", style="dim"))
            lines.append(Text(""))
        lines += _measured(frame.measured, frame.replay, roomy=height >= _ROOMY)
        return Group(*lines[: max(height, 1)])


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _measured(measured: dict[str, MeasuredLayout], replay: bool, roomy: bool) -> list[Text]:
    lines = [_line("measured, real runs of this request", "bold")] if roomy else []
    lines.append(_line(f"{'run':<5}{'tokens':>7}{'logical':>11}{'per token':>11}{'ITL mean':>10}", "dim underline"))
    for layout in ("gqa", "mha"):
        m = measured.get(layout)
        if m is None:
            hint = "not in this trace" if replay else "m runs this request with it"
            lines.append(_line(f"{layout:<5}  {hint}", "dim"))
            continue
        running = "" if m.finished else " …"
        lines.append(_line(
            f"{layout:<5}{m.tokens:>7}{m.logical_bytes / MIB:>7.3f} MiB{m.bytes_per_token / KIB:>7.1f} KiB"
            f"{ms(m.itl_mean_ms):>10}{running}"
        ))
    gqa, mha = measured.get("gqa"), measured.get("mha")
    if gqa is not None and mha is not None:
        same = f" ({mha.logical_bytes / gqa.logical_bytes:.2f}× at {gqa.tokens} tokens each)" if (
            mha.tokens == gqa.tokens) else ""
        lines.append(_line(f"MHA/GQA bytes {mha.bytes_per_token / gqa.bytes_per_token:.2f}×{same}", "bold"))
        if gqa.itl_mean_ms and mha.itl_mean_ms:
            lines.append(_line(
                f"MHA/GQA ITL   {mha.itl_mean_ms / gqa.itl_mean_ms:.2f}× "
                f"({gqa.itl_mean_ms:.1f} -> {mha.itl_mean_ms:.1f} ms mean)", "bold",
            ))
    return lines
