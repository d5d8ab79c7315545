"""`GET /metrics`: the server's counters and latency histograms in Prometheus' text format.

Names follow vLLM's (v1) under a `reqscope:` prefix, so a dashboard or alert written for
`vllm:time_to_first_token_seconds` works here with the prefix changed; every series carries a
`model_name` label, as vLLM's do. Histogram buckets are vLLM's.

Values are the engine's own measurements, taken when a request ends (its RequestResult:
metrics, timeline, usage), so /metrics, the telemetry file and the `reqscope` extension in the
response always agree. TTFT, E2E, TPOT and ITL are this project's definitions (docs/engine.md,
"Metrics, as defined here"): on the server's clock from the HTTP request's arrival, to the first
and last *visible* token. Two differences from vLLM follow, both named in the help text:
`time_per_output_token_seconds` is one observation per request (its TPOT), while every single
gap is in `inter_token_latency_seconds`; and the latency histograms count only requests that
produced visible text. Running and waiting requests and KV usage are read from the scheduler
at scrape time: running is every request in the engine's batch. Preemptions are counted as
they happen (`preempted`, fed each `PreemptEvent`), not when their request ends.

Each app gets its own CollectorRegistry (never prometheus_client's global one), so several
servers in one process, as in the tests, keep separate counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from minengine.engine.batch_facts import PreemptEvent
from minengine.engine.events import RequestResult
from minengine.engine.metrics import inter_token_gaps
from minengine.engine.scheduler import Scheduler
from reqscope.openai.responses import api_finish_reason

PREFIX = "reqscope:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# The finish reasons vLLM counts as a finished request (an engine error is not one).
SUCCESS_REASONS = ("stop", "length", "abort")


def token_count_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len`: vLLM's `build_1_2_5_buckets`."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


@dataclass(frozen=True)
class LiveState:
    """What the scrape reads from the engine at that moment."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV budget reserved by running requests, 0..1


def scheduler_state(scheduler: Scheduler) -> LiveState:
    """Running, waiting and KV usage as the scheduler counts them now."""
    budget = scheduler.kv_budget_bytes
    usage = scheduler.held_bytes / budget if budget > 0 else 0.0
    return LiveState(scheduler.running, scheduler.waiting, min(1.0, max(0.0, usage)))


class _LiveCollector(Collector):
    """Gauges computed at scrape time rather than kept up to date."""

    def __init__(self, model_name: str, read: Callable[[], LiveState]) -> None:
        self.model_name = model_name
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges, from one reading of the scheduler."""
        state = self.read()
        for name, help_text, value in (
            (
                "num_requests_running",
                "Requests admitted and running: the sequences the engine's steps batch (at most --max-num-seqs).",
                state.running,
            ),
            ("num_requests_waiting", "Requests waiting in the admission queue.", state.waiting),
            (
                "kv_cache_usage_perc",
                "KV cache usage as a fraction 0..1 of the KV budget (--kv-budget-mib) reserved by the running "
                "requests, every one in the batch; a request reserves its worst case, prompt + max_tokens, "
                "when admitted.",
                state.kv_usage,
            ),
        ):
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServeMetrics:
    """The metrics of one server; `observe` each finished request, `render` for a scrape."""

    def __init__(self, model_name: str, max_model_len: int, live: Callable[[], LiveState]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, help_text, [*labels, *extra], registry=self.registry)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, help_text, labels, registry=self.registry, buckets=buckets)

        # Counters are named without `_total`; prometheus_client adds it, as it does for vLLM.
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (requests that reached prefill).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens, EOS and stop tokens included.")
        self.request_success = counter(
            "request_success", "Finished requests by finish reason (stop, length, abort).", ("finished_reason",)
        )
        # As vLLM counts them: queries are the prompt tokens of every request that looked its
        # prompt up, hits the prompt tokens whose KV came from the cache (hits / queries is the
        # hit rate). A server started with --no-prefix-cache counts neither.
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries: prompt tokens of requests that looked their prompt up"
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits",
            "Prefix cache hits: prompt tokens whose KV was reused from the prefix cache, not prefilled "
            "(whole blocks; never a prompt's last token)",
        )
        self.preemptions = counter(
            "num_preemptions",
            "Preemptions: a running request's KV taken back to make room for others, its tokens recomputed later.",
        )
        visible = "; requests with visible output only"
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time to first token: HTTP arrival to the first visible token" + visible,
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Inter-token latency: every gap between consecutive tokens, from the first visible to the last",
            TOKEN_GAP_BUCKETS,
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Time per output token, one observation per request: (E2E - TTFT) / (output tokens - 1), for more "
            "than one token (vLLM's older metric of this name observed every gap: see inter_token_latency_seconds)",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "End-to-end latency: HTTP arrival to the last visible token" + visible,
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time spent waiting in the admission queue", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time spent in prefill (the prompt's forward pass, after any prefix cache hit)",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Time spent in decode, to the last visible token", REQUEST_LATENCY_BUCKETS
        )
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request that reached prefill", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request", token_buckets
        )
        # Series exist, at zero, from the first scrape: a rate over a series that appears only
        # with the first event would miss that event.
        for metric in (
            self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
            self.preemptions,
        ):  # fmt: skip
            metric.labels(model_name)
        for reason in SUCCESS_REASONS:
            self.request_success.labels(model_name, reason)
        for metric in (
            self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
            self.request_prompt_tokens, self.request_generation_tokens,
        ):  # fmt: skip
            metric.labels(model_name)
        self.registry.register(_LiveCollector(model_name, live))

    def observe(self, result: RequestResult) -> None:
        """Count one finished request (called once per request, from its worker thread)."""
        model = self.model_name
        stages = {s.name: s.duration_ms / 1000 for s in result.stages}
        prefilled = "prefill" in stages
        if prefilled:  # a request refused before admission never reached the model
            self.prompt_tokens.labels(model).inc(result.usage.prompt_tokens)
            self.request_prompt_tokens.labels(model).observe(result.usage.prompt_tokens)
            self.queue_time.labels(model).observe(result.queue_ms / 1000)
            self.prefill_time.labels(model).observe(stages["prefill"])
        prefix = result.prefix_cache
        if prefix is not None and prefix.enabled:
            self.prefix_cache_queries.labels(model).inc(prefix.prompt_tokens)
            self.prefix_cache_hits.labels(model).inc(prefix.reused_tokens)
        self.generation_tokens.labels(model).inc(result.usage.completion_tokens)
        reason = api_finish_reason(result.finish_reason)
        if reason in SUCCESS_REASONS and result.error is None:
            self.request_success.labels(model, reason).inc()
            self.request_generation_tokens.labels(model).observe(result.usage.completion_tokens)
        if "decode" in stages:
            self.decode_time.labels(model).observe(stages["decode"])
        metrics = result.metrics
        if metrics is None:
            return
        self.ttft.labels(model).observe(metrics.ttft_ms / 1000)
        self.e2e.labels(model).observe(metrics.e2e_ms / 1000)
        if metrics.tpot_ms is not None:
            self.tpot.labels(model).observe(metrics.tpot_ms / 1000)
        for gap_ms in _visible_gaps_ms(result):
            self.itl.labels(model).observe(gap_ms / 1000)

    def preempted(self, _event: PreemptEvent) -> None:
        """Count one preemption (called from the preempted request's worker thread, as it happens)."""
        self.preemptions.labels(self.model_name).inc()

    def render(self) -> bytes:
        """The text exposition of every metric, as a scrape receives it."""
        return generate_latest(self.registry)


def _visible_gaps_ms(result: RequestResult) -> tuple[float, ...]:
    """The gaps between token events from the first visible token to the last, as ITL counts them."""
    marks = {e.name: e.t_ms for e in result.timeline if e.name in ("first_visible_token", "last_visible_token")}
    first, last = marks.get("first_visible_token"), marks.get("last_visible_token")
    if first is None or last is None:
        return ()
    return inter_token_gaps([e.t_ms for e in result.timeline if e.name == "token" and first <= e.t_ms <= last])
