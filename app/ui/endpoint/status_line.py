"""The endpoint explorer's top line: the server, the model, the request and its state, the settings sent."""

from __future__ import annotations

from rich.text import Text

from reqscope.ui.endpoint.frame import EndpointFrame

_STATE_STYLE = {
    "connecting": "bold yellow",
    "waiting": "bold yellow",
    "streaming": "bold green",
    "error": "bold red",
    "cancelled": "bold magenta",
}


def endpoint_status(frame: EndpointFrame, number: int = 1) -> Text:
    """One line; the URL is cut first when narrow. `number` counts the requests sent this session."""
    p, view = frame.request.sampling, frame.view
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" reqscope ", style="bold reverse")
    state = frame.state
    shown = state if state in _STATE_STYLE else f"done ({state})"
    text.append(f" {shown} ", style=_STATE_STYLE.get(state, "bold"))
    server_id = view.response.request_id if view.response is not None else None
    text.append(f" #{number} {server_id or frame.request.request_id} · ")
    text.append("greedy" if p.greedy else f"T {p.temperature:g} k {p.top_k} p {p.top_p:g} min-p {p.min_p:g}")
    text.append(f" · seed {p.seed} · model {frame.model or '?'} ")
    if frame.next_request is not None:
        n = frame.next_request.sampling
        settings = "greedy" if n.greedy else f"T {n.temperature:g} k {n.top_k} p {n.top_p:g} min-p {n.min_p:g}"
        text.append(f"· next: {settings}, {frame.next_request.max_tokens} tokens (r sends) ", style="bold yellow")
    text.append(f"· {frame.url}", style="dim")
    return text
