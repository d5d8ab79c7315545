"""What the endpoint client emits while one request streams from an OpenAI-compatible server.

A consumer (the plain and JSON printers, the UI) receives, in order: RequestSent,
ConnectionReady, ResponseStarted, one ChunkReceived per chunk of visible text or of tool calls, and always a
closing StreamEnded whose result says whether it failed. Between them, where the server offers
them: BatchSample (its /metrics read while the request runs) and PromptProgress (llama-server's
progress through the prompt). After StreamEnded, a SpanReceived when a trace receiver listens and
the server's span for the request arrives. Every time is in milliseconds on the
client's monotonic clock, counted from the send, so `RequestSent.t_ms` is 0. Events can arrive
a little after the moment they record (the connection is known only once the response headers
are in), so consumers should place them by `t_ms`, not by arrival.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.engine.events import Usage
from minengine.engine.metrics import RequestMetrics
from minengine.engine.request import Message
from minengine.engine.timeline import TimelineEvent
from minengine.text.tools import ToolCall
from reqscope.endpoint.controls import OutputControls
from reqscope.endpoint.server.records import BatchSample, PromptProgress, ServerView
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.tool_calls import ToolCallPiece
from reqscope.openai.logprobs import TokenLogprob


@dataclass(frozen=True)
class RequestSent:
    """The request left the client (the timeline's origin, `client_send`), with what it asked for."""

    t_ms: float
    url: str
    model: str
    settings: RequestSettings = RequestSettings()  # the fields not set were left out of the body
    token_limit_field: str = "max_tokens"  # or max_completion_tokens, the name OpenAI's own API wants
    request_id: str = ""  # the X-Request-Id sent (a UUID), by which the server's own records name the request
    send_unix_ms: float = 0.0  # the client's wall clock at the send, to place a server's wall-clock times
    messages: tuple[Message, ...] = ()  # what the body carried, so a replay shows the request it draws
    display_id: str = ""  # the request's own name on the screens (`req-…`); request_id is the UUID sent
    controls: OutputControls = OutputControls()  # tools, output shape, penalties, bias: what the body asked
    server: str = ""  # the server's kind (ServerKind.name), for which the controls' fields were shaped


@dataclass(frozen=True)
class ConnectionReady:
    """The connection the request went over: opened for it, or reused from an earlier request."""

    t_ms: float
    reused: bool
    connect_ms: float | None  # time to open it (TCP, TLS); None when reused


@dataclass(frozen=True)
class ResponseStarted:
    """The status line and headers arrived (time to first byte)."""

    t_ms: float
    status: int
    request_id: str | None  # the server's x-request-id, when it sends one


@dataclass(frozen=True)
class ChunkReceived:
    """One streamed chunk of visible text; index 0 is the first visible token."""

    index: int
    t_ms: float
    text: str
    itl_ms: float | None  # gap since the previous chunk; None for the first
    logprobs: tuple[TokenLogprob, ...]  # one per token the chunk carries, when the server sends them
    tool_calls: tuple[ToolCallPiece, ...] = ()  # the pieces of tool calls it carried (its text may then be "")


@dataclass(frozen=True)
class ServerReport:
    """The server's own measurements of the request, as `reqscope serve` reports them.

    Times are on the server's clock, counted from the moment its HTTP handler saw the request.
    """

    request_id: str | None
    ttft_ms: float | None
    e2e_ms: float | None
    tpot_ms: float | None
    queue_ms: float | None
    output_tokens: int | None
    stages_ms: tuple[tuple[str, float], ...]  # (stage, duration) in lifecycle order
    events_ms: tuple[tuple[str, float], ...]  # (timeline event, time) in time order

    def stage_ms(self, name: str) -> float | None:
        """Duration of one server stage (gateway, template, tokenize, admit, prefill, ...)."""
        return next((ms for stage, ms in self.stages_ms if stage == name), None)


@dataclass(frozen=True)
class ServerTimings:
    """llama.cpp's server (llama-server) reports its own times in a `timings` object; fields keep its names.

    Times are on the server's clock. The prompt figures cover prompt processing (prefill) of
    the tokens not found in its cache; the predicted ones cover generation, token by token.
    """

    prompt_n: int | None  # prompt tokens evaluated (those not reused from its cache)
    prompt_ms: float | None
    prompt_per_second: float | None
    predicted_n: int | None  # tokens generated
    predicted_ms: float | None
    predicted_per_token_ms: float | None
    predicted_per_second: float | None
    cache_n: int | None = None  # prompt tokens reused from its cache (newer llama.cpp)
    draft_n: int | None = None  # speculative decoding: tokens drafted
    draft_n_accepted: int | None = None  # and accepted


@dataclass(frozen=True)
class DecodeComparison:
    """Client TPOT against the server's own time per output token.

    The server's figure is its decode alone; what the client sees beyond it
    (`outside_server_ms`) is writing and sending each chunk, the network and the client's reading.
    """

    client_ms: float
    server_ms: float
    source: str  # "reqscope" (its report's TPOT) or "timings" (llama.cpp's predicted_per_token_ms)

    @property
    def outside_server_ms(self) -> float:
        """Client TPOT minus the server's."""
        return self.client_ms - self.server_ms


@dataclass(frozen=True)
class TtftComparison:
    """Client-observed against server-observed TTFT.

    The server's TTFT already contains its gateway, queue and prefill; what the client sees
    beyond it (`outside_server_ms`) is connection setup, the network both ways, HTTP parsing
    before the server's clock starts and the client's own reading.
    """

    client_ms: float
    server_ms: float
    gateway_ms: float | None
    queue_ms: float | None
    prefill_ms: float | None

    @property
    def outside_server_ms(self) -> float:
        """Client TTFT minus server TTFT."""
        return self.client_ms - self.server_ms


@dataclass(frozen=True)
class EndpointResult:
    """Everything the client measured about one request."""

    url: str
    model: str
    status: int | None  # HTTP status; None when no response arrived
    request_id: str | None
    finish_reason: str | None
    text: str
    usage: Usage | None  # as the server reported it
    output_tokens: int  # O, the token count TPOT and the rates divide by
    output_tokens_source: str  # "usage", "logprobs" or "chunks" (one token per chunk assumed)
    chunks: int  # chunks of visible text; ITL has one fewer gaps
    timeline: tuple[TimelineEvent, ...]
    metrics: RequestMetrics | None  # ITL per chunk in metrics.itl, TPOT per token; None without text
    connection_reused: bool | None
    connect_ms: float | None
    server: ServerReport | None  # reqscope serve's report
    ttft: TtftComparison | None
    error: str | None = None
    timings: ServerTimings | None = None  # llama.cpp's timings
    logprob_tokens: int = 0  # tokens the server sent a logprob entry for
    tpot: DecodeComparison | None = None  # client TPOT against the server's, from either report
    server_view: ServerView | None = None  # what the server said of this request and its batch
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer made, put together from the stream


@dataclass(frozen=True)
class StreamEnded:
    """The request finished (or failed: `result.error`)."""

    result: EndpointResult


@dataclass(frozen=True)
class SpanReceived:
    """The server's trace span for the request arrived, after the stream ended (vLLM exports spans in
    batches, seconds later): `view` is the result's server view with the span and the TTFT split
    it allows."""

    view: ServerView


# The server's batch (one poll of its /metrics, and llama-server's /slots) and llama-server's progress
# through the prompt are records of their own (`reqscope.endpoint.server.records`), stamped on the
# client's clock, and travel as events as they are.
ClientEvent = (
    RequestSent | ConnectionReady | ResponseStarted | ChunkReceived | BatchSample | PromptProgress
    | StreamEnded | SpanReceived
)
