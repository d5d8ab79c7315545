"""One repaint of the endpoint explorer: what its panels draw from, gathered once per frame."""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.request import GenerationRequest
from minengine.plan.cards import Architecture
from reqscope.endpoint.settings import RequestSettings
from reqscope.ui.endpoint.view import EndpointView


@dataclass(frozen=True)
class Baseline:
    """The newest earlier request of this session sent without logprobs: what asking for them is measured against."""

    number: int  # its number in the session (#n on the status line)
    tpot_ms: float  # its client TPOT


@dataclass(frozen=True)
class EndpointFrame:
    """Everything drawn in one repaint of the endpoint explorer."""

    view: EndpointView
    url: str
    model: str  # the served model's name ("" until the server has been asked)
    request: GenerationRequest  # the request on screen: its messages (its sampling is not what was sent)
    state: str  # "connecting", "waiting", "streaming", "cancelled", "error" or the finish reason
    cursor: int | None = None  # the chunk the logprobs panel explains; None follows the newest
    arch: Architecture | None = None  # the served model's shape, from --card, for the planner's KV
    new_connection: bool = False  # --new-connection: every request opens its own connection
    settings: RequestSettings = RequestSettings()  # what the request on screen was sent with (None: server default)
    next_settings: RequestSettings | None = None  # changed settings, waiting for the next send
    baseline: Baseline | None = None  # to measure the logprobs' cost against, when the request asks for them
    poll_ms: float = 0.0  # how often the server's batch is read while a request runs (0: never)
    otlp_listen: bool = False  # a receiver waits for the server's trace spans (--otlp-listen)
