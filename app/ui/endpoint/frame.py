"""One repaint of the endpoint explorer: what its panels draw from, gathered once per frame."""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.request import GenerationRequest
from minengine.plan.cards import Architecture
from reqscope.ui.endpoint.view import EndpointView


@dataclass(frozen=True)
class EndpointFrame:
    """Everything drawn in one repaint of the endpoint explorer."""

    view: EndpointView
    url: str
    model: str  # the served model's name ("" until the server has been asked)
    request: GenerationRequest  # the request on screen, as sent
    state: str  # "connecting", "waiting", "streaming", "cancelled", "error" or the finish reason
    cursor: int | None = None  # the chunk the logprobs panel explains; None follows the newest
    arch: Architecture | None = None  # the served model's shape, from --config, for the planner's KV
    new_connection: bool = False  # --new-connection: every request opens its own connection
    next_request: GenerationRequest | None = None  # changed settings, waiting for the next send
