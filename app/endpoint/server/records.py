"""What a server reports about one request and the batch around it, as typed records.

Every record names its source (the server and the route or field it came from), so a figure on
screen, in `--json` or in an export can always be traced back to who measured it. Times marked
`t_ms` are on the client's clock (milliseconds from the send, as every client event); the
server's own durations keep the server's clock, and `unix_ms` fields are wall-clock times.
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM = "vllm"
LLAMA_SERVER = "llama-server"
REQSCOPE = "reqscope"
SGLANG = "sglang"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class ServerKind:
    """Which server answers at the endpoint, as its own routes tell (`GET /version`, `GET /props`)."""

    name: str  # VLLM, LLAMA_SERVER, SGLANG, REQSCOPE or UNKNOWN
    version: str | None = None
    root: str = ""  # the server's root URL: the base URL without its trailing /v1


@dataclass(frozen=True)
class VllmRequestMetrics:
    """vLLM's per-request metrics (`--enable-per-request-metrics`): the final usage chunk's `metrics`.

    Its TTFT is counted from the moment the scheduler took the request, not from its arrival:
    the queue comes before it, in `queue_time_ms`.
    """

    queue_time_ms: float | None
    time_to_first_token_ms: float | None
    generation_time_ms: float | None
    mean_itl_ms: float | None
    tokens_per_second: float | None


@dataclass(frozen=True)
class ServerSpan:
    """vLLM's `llm_request` span for this request, as its OTLP exporter sent it to our receiver.

    Durations are the span's `gen_ai.latency.*` attributes, in milliseconds on the server's clock;
    `start_unix_ms`/`end_unix_ms` are the span's own times (the request's arrival and its end).
    """

    request_id: str
    start_unix_ms: float
    end_unix_ms: float
    queue_ms: float | None
    ttft_ms: float | None  # from arrival
    prefill_ms: float | None
    decode_ms: float | None
    inference_ms: float | None
    e2e_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True)
class PromptProgress:
    """One `prompt_progress` chunk from llama-server (`return_progress`), while it processes the prompt."""

    t_ms: float  # client clock, on arrival
    total: int  # prompt tokens in all
    cache: int  # of them, taken from its cache
    processed: int  # processed so far (cached ones included)
    time_ms: float  # server clock: time spent on the prompt so far


@dataclass(frozen=True)
class SlotState:
    """One llama-server slot, as `/slots` shows it."""

    id: int
    processing: bool
    task: int | None  # `id_task`: the request it serves
    n_ctx: int | None
    decoded: int | None  # `next_token.n_decoded`


@dataclass(frozen=True)
class BatchSample:
    """One poll of the server's `/metrics` (and llama-server's `/slots`) while the request ran.

    Counters (`*_total`) are the server's totals since it started; the panel shows their change.
    A field the server does not export stays None.
    """

    t_ms: float  # client clock, when the answer arrived
    source: str  # e.g. "vLLM /metrics", "llama-server /metrics + /slots"
    running: float | None = None  # vllm:num_requests_running, llamacpp:requests_processing
    waiting: float | None = None  # vllm:num_requests_waiting, llamacpp:requests_deferred
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, as a fraction (0 to 1)
    preemptions_total: float | None = None  # vllm:num_preemptions_total
    prefix_queries_total: float | None = None  # vllm:prefix_cache_queries_total (tokens)
    prefix_hits_total: float | None = None  # vllm:prefix_cache_hits_total (tokens)
    prompt_tokens_total: float | None = None  # vllm:prompt_tokens_total, llamacpp:prompt_tokens_total
    busy_slots_per_decode: float | None = None  # llamacpp:n_busy_slots_per_decode
    slots: tuple[SlotState, ...] = ()  # llama-server's /slots
    poll_ms: float = 0.0  # the poll's round trip on the client's clock


@dataclass(frozen=True)
class ServerPrompt:
    """The chat template and tokens the server itself made of this request's messages."""

    source: str  # e.g. "vLLM /tokenize (messages)", "llama-server /apply-template + /tokenize"
    token_ids: tuple[int, ...]
    pieces: tuple[str, ...] = ()  # each token's text, where the server gives it
    text: str | None = None  # the rendered template, where the server gives it


@dataclass(frozen=True)
class ToolsCost:
    """What the request's tools cost in prompt tokens, by the server's own template and tokenizer:
    the same messages counted with the tools and without them."""

    with_tools: int
    without_tools: int
    source: str  # the routes that counted, e.g. "vLLM /tokenize"

    @property
    def tokens(self) -> int:
        """The prompt tokens the tools add."""
        return self.with_tools - self.without_tools

    @property
    def dropped(self) -> bool:
        """The server's template rendered the prompt without the tools (the counts are equal): the
        model never saw them (vLLM does that silently for a template without tool syntax)."""
        return self.with_tools == self.without_tools

    def line(self) -> str:
        """"tools cost 123 prompt tokens (240 with, 117 without; vLLM /tokenize)", or the drop."""
        if self.dropped:
            return (
                f"the server's template dropped the tools: the prompt is {self.with_tools} tokens "
                f"with them and without ({self.source})"
            )
        counts = f"{self.with_tools} with, {self.without_tools} without"
        return f"tools cost {self.tokens} prompt tokens ({counts}; {self.source})"


@dataclass(frozen=True)
class TtftSplit:
    """The client's TTFT as one bar: connection and HTTP, the server's queue, its prefill and first
    token, and delivery back to the client.

    `joined` is True where the server reports no times on a shared clock: connection and delivery
    are then one figure (`outside_ms`), the client's TTFT less the server's. `clock_note` says where
    the two clocks disagree (a server figure larger than the client's whole TTFT, a span that starts
    before the request was sent).
    """

    client_ttft_ms: float
    connection_http_ms: float | None
    queue_ms: float | None
    prefill_first_token_ms: float | None
    delivery_ms: float | None
    outside_ms: float | None
    source: str  # where the server's part came from
    joined: bool = False
    clock_note: str | None = None
    # Of connection and HTTP, the part inside the server before its queue (its API: the chat
    # template, tokenizing); known from vLLM's span only.
    server_api_ms: float | None = None


@dataclass(frozen=True)
class OffView:
    """A view the server could give but did not, and the flag that turns it on."""

    view: str  # e.g. "per-request timing"
    flag: str  # e.g. "--enable-per-request-metrics"
    how: str  # one line: where to put the flag

    def line(self) -> str:
        """The one line shown for it."""
        return f"{self.view}: off; {self.how}"


@dataclass(frozen=True)
class SglangMetaInfo:
    """SGLang's `meta_info` fields that reqscope reads, under SGLang's names (times as SGLang gives
    them), from `reqscope.endpoint.server.sglang`: untested against a live SGLang."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    queue_time: float | None = None
    prefill_launch_latency: float | None = None
    e2e_latency: float | None = None
    total_retractions: int | None = None


@dataclass(frozen=True)
class ServerView:
    """Everything the server said about this request and the batch around it, with the split of TTFT
    that follows, and the views it could give but did not (each with the flag that turns it on)."""

    kind: ServerKind
    request_id: str  # the X-Request-Id the client sent (a UUID), to match the server's records
    send_unix_ms: float  # the client's wall clock at the send (the timeline's origin)
    display_id: str = ""  # the request's own name on the screens (`req-…`)
    poll_interval_ms: float = 0.0  # how often /metrics was read while the request ran (0: not read)
    vllm_metrics: VllmRequestMetrics | None = None
    span: ServerSpan | None = None
    progress: tuple[PromptProgress, ...] = ()
    batch: tuple[BatchSample, ...] = ()
    prompt: ServerPrompt | None = None  # the template and tokens the server made of the messages
    prompt_error: str | None = None  # why they could not be read
    prompt_token_ids: tuple[int, ...] | None = None  # the ids the request itself returned (vLLM's return_token_ids)
    ttft_split: TtftSplit | None = None
    off: tuple[OffView, ...] = ()
    sglang_meta: SglangMetaInfo | None = None  # untested against a live SGLang
    tools_cost: ToolsCost | None = None  # where the request offered tools and the server could count them
    tools_cost_error: str | None = None  # why they could not be counted

    @property
    def poll_cost_ms(self) -> float | None:
        """The mean round trip of one poll: the client's thread spent it off the stream."""
        if not self.batch:
            return None
        return sum(s.poll_ms for s in self.batch) / len(self.batch)
