"""The top line: which model, which request, what state it is in, and the settings in force."""

from __future__ import annotations

from rich.text import Text

from minengine.engine.request import GenerationRequest
from minengine.sampling.params import SamplingParams
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
    if frame.load is not None:  # said early: it is why the figures move
        shared = [f"+{frame.load.background} background"] if frame.load.background else []
        shared += [f"API {frame.load.serve_url}/v1"] if frame.load.serve_url else []
        text.append(f" {' · '.join(shared)} ", style="bold magenta")
    if h.kernels == "reference":  # said early, as the load is: every step's arithmetic is the plain model's
        text.append(" reference kernels ", style="bold cyan")
    settings = "greedy" if p.greedy else f"T {p.temperature:g} k {p.top_k} p {p.top_p:g} min-p {p.min_p:g}"
    kv = view.kv
    layout = kv.layout if kv is not None else "?"
    text.append(f" {frame.request_id} · {settings} · seed {p.seed} · {layout} cache ")
    if frame.settings_note:
        text.append(f"({frame.settings_note}) ", style="dim")
    model = h.model.rstrip("/").split("/")[-1]
    text.append(f"· {model}: {h.layers}L {h.q_heads}q/{h.kv_heads}kv {h.device} {h.dtype}", style="dim")
    if h.weights_why:  # traces from before the format was a choice say nothing of it (they were float32)
        text.append(f" · weights {h.weights} ({h.weights_why})", style="dim")
    if source_name:
        text.append(f" · from {source_name}", style="dim")
    return text


_SHORT = {"temperature": "T", "top_k": "k", "top_p": "p", "min_p": "min-p", "seed": "seed", "max_tokens": "max"}
_GROUP = {"flag": "set", "reqscope default": "default"}  # anything else is a model file: "model"


def settings_note(request: GenerationRequest | None, params: SamplingParams) -> str:
    """Where the values in force came from, grouped: "set: k · model: T p · default: min-p seed max".

    Empty when the request does not say, or once the sampling form changed them (then they are
    simply the user's).
    """
    if request is None or not request.setting_sources:
        return ""
    if params != request.sampling:
        return "set in the explorer"
    groups: dict[str, list[str]] = {}
    for s in request.setting_sources:
        groups.setdefault(_GROUP.get(s.source, "model"), []).append(_SHORT.get(s.name, s.name))
    return " · ".join(f"{group}: {' '.join(names)}" for group, names in groups.items())
