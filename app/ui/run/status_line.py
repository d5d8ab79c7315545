"""The top line: which model, which request, what state it is in, and the settings in force."""

from __future__ import annotations

from rich.text import Text

from reqscope.ui.run.frame import Frame

_STATE_STYLE = {
    "running": "bold green",
    "pausing": "bold yellow",
    "paused": "bold yellow",
    "error": "bold red",
    "cancelled": "bold magenta",
    "replay": "bold cyan",
}


def status_text(frame: Frame, source_name: str = "", playing: bool = False) -> Text:
    """One line; the model description (and the replayed file's name) is cut first when narrow."""
    h, p, view = frame.header, frame.params, frame.view
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" reqscope ", style="bold reverse")
    state = frame.state
    if frame.replay:
        shown = len(view.tokens)
        state = f"replay {'▶' if playing else '❚❚'} token {shown}"
    elif state == "paused" and view.waiting_step is not None:
        state = f"paused at step {view.waiting_step + 1}"
    elif state in ("stop", "length", "stop_sequence"):
        state = f"done ({state})"
    text.append(f" {state} ", style=_STATE_STYLE.get(frame.state, "bold"))
    settings = "greedy" if p.greedy else f"T {p.temperature:g} k {p.top_k} p {p.top_p:g} min-p {p.min_p:g}"
    kv = view.kv
    layout = kv.layout if kv is not None else "?"
    text.append(f" {frame.request_id} · {settings} · seed {p.seed} · {layout} cache ")
    model = h.model.rstrip("/").split("/")[-1]
    text.append(f"· {model}: {h.layers}L {h.q_heads}q/{h.kv_heads}kv {h.device} {h.dtype}", style="dim")
    if source_name:
        text.append(f" · from {source_name}", style="dim")
    return text
