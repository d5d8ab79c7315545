"""Where the step's query looked in the KV cache: a layer × head grid, then one layer's most-attended tokens.

The grid has a column per layer and a row per query head, the heads that read one stored K/V
head bracketed together (GQA's sharing; under MHA each head has its own). A cell is the weight
the head put on its single most-attended position: full when it looked at one token, faint when
it spread over many. The detail names the chosen layer's (and head's, or the mean over its
heads') top positions with their tokens and where each came from, and shades the prompt strip
by the layer's weights when the step kept them.
"""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.style import Style
from rich.text import Text

from minengine.inspect.records import Attended, LayerAttention, StepAttention, StepInspection
from reqscope.ui.glyphs import show_piece
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.inside.cached_tokens import kind_label, origin, position_piece
from reqscope.ui.run.inside.focus import AttentionFocus, window_start
from reqscope.ui.run.inside.panel import InsidePanel
from reqscope.ui.run.inside.shown import ShownInspection

# A cell's glyph by the weight on its top position (below each bound, the glyph at its side).
_RAMP = ((0.1, "·"), (0.25, "░"), (0.5, "▒"), (0.75, "▓"), (1.01, "█"))
_LABEL_WIDTH = 9  # "kv2 ┬ h8 " in front of each grid row
_DETAIL_MIN_WIDTH = 34  # the detail beside the grid from this width on, else under it
_TICK = 5  # a layer number over every fifth column
_SHADE = (208, 128, 0)  # the strip's shade at the step's highest weight
_WRAPPER = Console(width=1000)  # rich wraps a Text through a console; its own width does not matter


def cell_glyph(weight: float) -> str:
    """The grid glyph for a head whose top position took `weight` of its attention."""
    return next(glyph for bound, glyph in _RAMP if weight < bound)


class AttentionPanel(InsidePanel[StepAttention]):
    """The concentration grid beside (or above) the chosen layer's top positions, then the shaded strip."""

    TITLE = "Attention of the step"
    RECORD = "attention"
    LIVE_NOTE = ("attention shows from the next step: it is captured while this panel is on screen "
                 "(paused, the held step's full view)")

    def part(self, inspection: StepInspection) -> StepAttention | None:
        return inspection.attention

    def draw_part(self, frame: Frame, shown: ShownInspection, attention: StepAttention, width: int,
                  height: int) -> RenderableType:
        focus = frame.focus.clamped(len(attention.layers), attention.q_heads)
        lines = [_summary(shown, attention), _line(
            f"cell: weight on its top position  ·<10% ░<25% ▒<50% ▓<75% █  "
            f"[ ] layer  {{ }} head{'  m: other layout' if not frame.replay else ''}", "dim")]
        room = max(height - len(lines), 1)
        grid_width = min(width, _LABEL_WIDTH + len(attention.layers))
        grid = _grid(attention, focus, width if width - grid_width < _DETAIL_MIN_WIDTH else grid_width, room)
        layer = attention.layers[focus.shown_layer]
        if width - grid_width >= _DETAIL_MIN_WIDTH + 2:
            detail = _detail(frame, attention, layer, focus, width - grid_width - 2, room)
            body = [_beside(g, d, grid_width + 2) for g, d in _pad(grid, detail)]
        else:
            rest = room - len(grid)
            body = grid + (_detail(frame, attention, layer, focus, width, rest) if rest >= 3 else [])
        lines += body
        spare = height - len(lines)
        if spare >= 3:
            lines += _strip(frame, attention, layer, width, spare)
        return Group(*lines[: max(height, 1)])


def _summary(shown: ShownInspection, attention: StepAttention) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(shown.label, style="italic")
    text.append(f"  {shown.cost_text}", style="yellow")
    text.append(f"  {attention.layout} {attention.q_heads} q heads / {attention.kv_heads} KV", style="bold")
    text.append(f"  query at {attention.query_position} over {attention.context} cached")
    return text


def _grid(attention: StepAttention, focus: AttentionFocus, width: int, room: int) -> list[Text]:
    """The tick row and a row per query head, windowed round the focus when the model is larger than the room."""
    columns = max(width - _LABEL_WIDTH, 1)
    first_layer = window_start(focus.shown_layer, len(attention.layers), columns)
    layers = attention.layers[first_layer : first_layer + columns]
    ticks = "".join(_tick_row(layers))
    rows = [_line(f"{'layer':<{_LABEL_WIDTH}}{ticks}", "dim")]
    heads = max(room - 1, 1)
    first_head = window_start(focus.head or 0, attention.q_heads, heads)
    for head in range(first_head, min(first_head + heads, attention.q_heads)):
        rows.append(_grid_row(attention, layers, head, focus))
    return rows


def _tick_row(layers: tuple[LayerAttention, ...]) -> list[str]:
    out, skip = [], 0
    for lay in layers:
        if skip:
            skip -= 1
            continue
        if lay.layer % _TICK == 0:
            label = str(lay.layer)
            out.append(label)
            skip = len(label) - 1
        else:
            out.append(" ")
    return out


def _grid_row(attention: StepAttention, layers: tuple[LayerAttention, ...], head: int, focus: AttentionFocus) -> Text:
    group = attention.group_size
    kv, member = divmod(head, group)
    bracket = "─" if group == 1 else "┬" if member == 0 else "└" if member == group - 1 else "├"
    chosen = focus.head == head
    label = f"{f'kv{kv}' if member == 0 else '':<4}{bracket} h{head:<2}"
    text = Text(no_wrap=True, overflow="crop")
    text.append(label[: _LABEL_WIDTH - 1].ljust(_LABEL_WIDTH), style="bold" if chosen else "dim")
    for lay in layers:
        weight = lay.heads[head].top_weight if head < len(lay.heads) else 0.0
        style = "reverse" if lay.layer == focus.shown_layer and (focus.head is None or chosen) else (
            "bold" if lay.layer == focus.shown_layer else "")
        text.append(cell_glyph(weight), style=style)
    return text


def _detail(frame: Frame, attention: StepAttention, layer: LayerAttention, focus: AttentionFocus,
            width: int, room: int) -> list[Text]:
    """The chosen layer's (head's) most-attended positions: position, token, weight, origin."""
    if focus.head is None:
        top, title = layer.mean_top, f"layer {layer.layer} · mean of {len(layer.heads)} heads"
        entropy = layer.mean_entropy
    else:
        head = layer.heads[focus.head]
        top, title = head.top, f"layer {layer.layer} · head {head.head} (kv {head.kv_head})"
        entropy = head.entropy
    lines = [_line(f"{title} · H {entropy:.2f} nats", "bold"),
             _line(f"{'pos':>5} {'token':<12} {'weight':>6}  kind", "dim underline")]
    for attended in top[: max(room - len(lines), 0)]:
        lines.append(_position_line(frame, attended, attention.query_position))
    return [_cut(line, width) for line in lines]


def _position_line(frame: Frame, attended: Attended, query: int) -> Text:
    found = origin(frame.view, attended.position)
    piece = show_piece(position_piece(frame.view, attended.position), 12)
    mark = " ◀ query" if attended.position == query else ""
    return _line(f"{attended.position:>5} {piece:<12} {attended.weight:6.1%}  {kind_label(found)}{mark}")


def _strip(frame: Frame, attention: StepAttention, layer: LayerAttention, width: int, rows: int) -> list[Text]:
    """The cached tokens in order, each shaded by the layer's weight on it (the strip kept, else its top positions)."""
    weights = _position_weights(attention, layer)
    peak = max(weights.values(), default=0.0) or 1.0
    what = "every position" if layer.strip is not None else f"its top {len(layer.mean_top)} positions"
    heading = _line(f"the cache shaded by layer {layer.layer}'s mean weight ({what}); +r reused", "dim")
    text = Text(overflow="fold")
    for position in range(attention.context):
        weight = weights.get(position, 0.0)
        piece = show_piece(position_piece(frame.view, position), 16)
        style = _shade(weight / peak)
        if origin(frame.view, position).reused:
            style += Style(underline=True)
        text.append(piece, style=style)
        text.append(" ")
    body = list(text.wrap(_WRAPPER, width))
    if len(body) > rows - 1:  # a long context: its end, where the newest tokens are
        body = [_line("…", "dim")] + body[-(rows - 2):] if rows > 2 else body[-1:]
    return [heading, *body]


def _position_weights(attention: StepAttention, layer: LayerAttention) -> dict[int, float]:
    if layer.strip is not None:
        return {p: layer.strip.weight_at(p) for p in range(attention.context)}
    return {a.position: a.weight for a in layer.mean_top}


def _shade(level: float) -> Style:
    level = min(max(level, 0.0), 1.0)
    if level <= 0.0:
        return Style(dim=True)
    r, g, b = (round(c * level) for c in _SHADE)
    return Style(bgcolor=f"rgb({r},{g},{b})", bold=level > 0.5)


def _pad(left: list[Text], right: list[Text]) -> list[tuple[Text, Text]]:
    n = max(len(left), len(right))
    return [(left[i] if i < len(left) else Text(""), right[i] if i < len(right) else Text("")) for i in range(n)]


def _beside(left: Text, right: Text, at: int) -> Text:
    line = left.copy()
    line.pad_right(max(at - line.cell_len, 0))
    line.append_text(right)
    line.no_wrap = True
    return line


def _cut(text: Text, width: int) -> Text:
    text = text.copy()
    text.truncate(width, overflow="ellipsis")
    return text


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")
