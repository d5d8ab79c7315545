"""GQA against MHA and MQA: formula sizes at the current token count, and both layouts measured."""

from __future__ import annotations

from reqscope.ui.frame import Frame
from reqscope.ui.glyphs import ms
from reqscope.ui.layout_compare import MeasuredLayout, formula_rows
from reqscope.ui.panel import Panel
from rich.console import Group, RenderableType
from rich.text import Text

from minengine.kv_math import KIB, MIB

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
            f"{'formula':<8}{'heads':>6}{'per token':>12}{f'at {kv.tokens} tok':>14}{'vs model':>10}",
            "dim underline",
        ))
        rows = formula_rows(h, kv)
        own = rows[0].bytes_per_token
        for row in rows:
            lines.append(_line(
                f"{row.name:<8}{row.heads:>6}{row.bytes_per_token / KIB:>8.1f} KiB"
                f"{row.bytes_now / MIB:>10.3f} MiB{row.bytes_per_token / own:>9.2f}×",
                "bold" if row is rows[0] else "",
            ))
        if height >= _ROOMY:
            lines.append(Text(""))
        lines += _measured(frame.measured, frame.replay)
        return Group(*lines[: max(height, 1)])


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _measured(measured: dict[str, MeasuredLayout], replay: bool) -> list[Text]:
    lines = [_line(f"{'measured':<8}{'tokens':>6}{'logical':>14}{'per token':>12}{'ITL mean':>11}", "dim underline")]
    for layout in ("gqa", "mha"):
        m = measured.get(layout)
        if m is None:
            hint = "not in this trace" if replay else "press m to run this request with it"
            lines.append(_line(f"{layout:<8}  {hint}", "dim"))
            continue
        running = "" if m.finished else " …"
        lines.append(_line(
            f"{layout:<8}{m.tokens:>6}{m.logical_bytes / MIB:>10.3f} MiB{m.bytes_per_token / KIB:>8.1f} KiB"
            f"{ms(m.itl_mean_ms):>11}{running}"
        ))
    gqa, mha = measured.get("gqa"), measured.get("mha")
    if gqa is not None and mha is not None:
        ratio = Text(no_wrap=True, overflow="ellipsis")
        ratio.append(f"MHA/GQA: {mha.bytes_per_token / gqa.bytes_per_token:.2f}× bytes", style="bold")
        if mha.tokens == gqa.tokens:
            ratio.append(f" (same {gqa.tokens} tokens: {mha.logical_bytes / gqa.logical_bytes:.2f}×)")
        if gqa.itl_mean_ms and mha.itl_mean_ms:
            ratio.append(f", {mha.itl_mean_ms / gqa.itl_mean_ms:.2f}× ITL", style="bold")
        lines.append(ratio)
    return lines
