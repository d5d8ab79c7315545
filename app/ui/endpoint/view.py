"""What the endpoint explorer knows about one request: the client's events so far, folded into one record.

The client's pipeline differs from the engine's: it sees a connection, the server's first
byte, the first visible token, the stream and the end, and nothing in between. Each stage's
time is the gap between the two client events that bound it, all on the client's clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from minengine.engine.metrics import RequestMetrics
from minengine.errors import ReqscopeError
from minengine.text.tools import ToolCall
from reqscope.endpoint import events as ev
from reqscope.endpoint.client_metrics import client_metrics, output_token_count
from reqscope.endpoint.server.records import BatchSample, PromptProgress, ServerView
from reqscope.endpoint.tool_calls import ToolCallAssembler
from reqscope.openai.logprobs import TokenLogprob
from reqscope.ui.request_view import RequestView

# The client's stages, in order: opening (or reusing) the connection, waiting for the status
# line, waiting for the first visible token, the stream from first to last token, the close.
CLIENT_PIPELINE: tuple[str, ...] = ("connect", "first byte", "first token", "stream", "close")


@dataclass
class EndpointView(RequestView[ev.ClientEvent]):
    """Everything drawn about one endpoint request, updated one client event at a time."""

    sent: ev.RequestSent | None = None
    connection: ev.ConnectionReady | None = None
    response: ev.ResponseStarted | None = None
    chunks: list[ev.ChunkReceived] = field(default_factory=list)
    batch: list[BatchSample] = field(default_factory=list)  # the server's batch, poll by poll
    progress: list[PromptProgress] = field(default_factory=list)  # llama-server's progress through the prompt
    result: ev.EndpointResult | None = None
    cancelled: bool = False  # the user closed the stream before it ended
    events: list[ev.ClientEvent] = field(default_factory=list)  # every event so far, for an export

    def apply(self, event: ev.ClientEvent) -> None:
        """Fold one event in."""
        self.events.append(event)
        match event:
            case ev.RequestSent():
                self.sent = event
            case ev.ConnectionReady():
                self.connection = event
            case ev.ResponseStarted():
                self.response = event
            case ev.ChunkReceived():
                self.chunks.append(event)
            case BatchSample():
                self.batch.append(event)
            case PromptProgress():
                self.progress.append(event)
            case ev.StreamEnded():
                self.result = event.result
            case ev.SpanReceived() if self.result is not None:
                self.result = dataclasses.replace(self.result, server_view=event.view)

    @property
    def server(self) -> ServerView | None:
        """The server's view of the request, once the stream has ended (the span may come later)."""
        return self.result.server_view if self.result is not None else None

    # -- derived -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the stream ended, failed or was cancelled."""
        return self.result is not None or self.cancelled

    @property
    def text(self) -> str:
        """The answer as streamed so far."""
        return self.result.text if self.result is not None else "".join(c.text for c in self.chunks)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls the answer made: put together from the chunks so far, the result's once it ended."""
        if self.result is not None:
            return self.result.tool_calls
        assembler = ToolCallAssembler()
        for chunk in self.chunks:
            assembler.add(chunk.tool_calls)
        return assembler.calls()

    @property
    def error(self) -> str | None:
        """Why the request failed, when it did."""
        return self.result.error if self.result is not None else None

    @property
    def token_logprobs(self) -> list[TokenLogprob]:
        """Every per-token logprob entry the server sent, in order."""
        return [entry for chunk in self.chunks for entry in chunk.logprobs]

    def output_tokens(self) -> tuple[int, str]:
        """O so far and where it came from ("usage", "logprobs" or "chunks")."""
        if self.result is not None:
            return self.result.output_tokens, self.result.output_tokens_source
        return output_token_count(None, len(self.token_logprobs), len(self.chunks))

    def metrics(self) -> RequestMetrics | None:
        """The client's metrics: the final ones once done, else the same formulas on the chunks so far."""
        if self.result is not None:
            return self.result.metrics
        if not self.chunks:
            return None
        try:
            return client_metrics([c.t_ms for c in self.chunks], self.output_tokens()[0])
        except ReqscopeError:
            return None  # two chunks on one clock tick: wait for the next

    def itls_ms(self) -> list[float]:
        """Every gap between consecutive chunks (ITL is per chunk)."""
        return [c.itl_ms for c in self.chunks if c.itl_ms is not None]

    def current_stage(self) -> str | None:
        """The client stage in progress; None once the request ended."""
        if self.done:
            return None
        if self.response is None:
            return "connect" if self.connection is None else "first byte"
        return "first token" if not self.chunks else "stream"

    def stage_ms(self, name: str) -> float | None:
        """How long a client stage took (so far, for the running one); None before it started."""
        conn, resp, chunks = self.connection, self.response, self.chunks
        if name == "connect":
            if conn is None:
                return None
            return conn.connect_ms if conn.connect_ms is not None else 0.0
        if name == "first byte":
            return resp.t_ms - (conn.t_ms if conn else 0.0) if resp else None
        if name == "first token":
            return chunks[0].t_ms - resp.t_ms if chunks and resp else None
        if name == "stream":
            return chunks[-1].t_ms - chunks[0].t_ms if chunks else None
        if name == "close" and self.result is not None:
            completed = next((e.t_ms for e in reversed(self.result.timeline) if e.name == "completed"), None)
            last = chunks[-1].t_ms if chunks else (resp.t_ms if resp else 0.0)
            return completed - last if completed is not None else None
        return None

    def stage_detail(self, name: str) -> str:
        """A short note for a stage: reused or new connection, HTTP status, chunk count."""
        if name == "connect" and self.connection is not None:
            return "reused" if self.connection.reused else "new"
        if name == "first byte" and self.response is not None:
            return f"HTTP {self.response.status}"
        if name == "stream" and self.chunks:
            return f"{len(self.chunks)} chunks"
        if name == "close" and self.result is not None:
            return self.result.finish_reason or ("error" if self.result.error else "")
        return ""
