"""The endpoint explorer's top line: the server, the model, the request and its state, the settings sent."""

from __future__ import annotations

from rich.text import Text

from reqscope.endpoint.settings import short_settings
from reqscope.ui.endpoint.frame import EndpointFrame

_STATE_STYLE = {
    "connecting": "bold yellow",
    "waiting": "bold yellow",
    "streaming": "bold green",
    "error": "bold red",
    "cancelled": "bold magenta",
}


def endpoint_status(frame: EndpointFrame, number: int = 1) -> Text:
    """One line; the URL is cut first when narrow. `number` counts the requests sent this session.

    The settings are those sent: a field left out shows as "server default", and asking for
    logprobs shows in yellow, since it may slow the server being measured.
    """
    view, settings = frame.view, frame.settings
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" reqscope ", style="bold reverse")
    state = frame.state
    shown = state if state in _STATE_STYLE else f"done ({state})"
    text.append(f" {shown} ", style=_STATE_STYLE.get(state, "bold"))
    # The request's own name: the X-Request-Id sent (and echoed) is a UUID, for matching, not reading.
    name = view.sent.display_id if view.sent is not None and view.sent.display_id else frame.request.request_id
    text.append(f" #{number} {name} · ")
    if settings.logprobs:  # ahead of the settings, so a narrow line cuts them rather than the warning
        text.append(f"logprobs top {settings.top_logprobs}: may slow the server", style="bold yellow")
        text.append(" · ")
    text.append(short_settings(settings))
    text.append(f" · model {frame.model or '?'} ")
    if frame.next_settings is not None:
        n = frame.next_settings
        logprobs = f", logprobs top {n.top_logprobs}" if n.logprobs else ", no logprobs"
        text.append(f"· next: {short_settings(n)}{logprobs} (r sends) ", style="bold yellow")
    text.append(f"· {frame.url}", style="dim")
    return text
