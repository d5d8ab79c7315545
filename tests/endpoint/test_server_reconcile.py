"""The TTFT split and the ITL spike marks, against the arithmetic they promise.

The split's parts must add up to the client's TTFT (the seeds' decomposition: what the client
sees is the server's time plus what lies outside it); the clocks' disagreement must be said;
a spike is a gap of at least 3x the median, marked with the batch's change between the polls
around it.
"""

from __future__ import annotations

import pytest

from reqscope.endpoint.server.hints import off_views
from reqscope.endpoint.server.reconcile import (
    best_split,
    spike_marks,
    split_from_llama,
    split_from_span,
    split_from_vllm_metrics,
)
from reqscope.endpoint.server.records import (
    LLAMA_SERVER,
    VLLM,
    BatchSample,
    PromptProgress,
    ServerKind,
    ServerSpan,
    ServerView,
    VllmRequestMetrics,
)
from reqscope.endpoint.server.words import split_line, split_parts

SEND = 1_700_000_000_000.0  # the client's wall clock at the send, in ms


def _span(start_after_send_ms: float, ttft: float, queue: float, prefill: float) -> ServerSpan:
    return ServerSpan("chatcmpl-x", SEND + start_after_send_ms, SEND + 500, queue, ttft, prefill, 300.0, 400.0,
                      480.0, 12, 20)


def test_a_span_places_the_server_inside_the_clients_ttft_and_the_parts_add_up():
    split = split_from_span(120.0, SEND, _span(start_after_send_ms=4.0, ttft=100.0, queue=30.0, prefill=65.0))
    # 4 ms to arrive, then 5 ms in vLLM's API (100 - 30 - 65) before the queue: both before the engine.
    assert split.connection_http_ms == pytest.approx(9.0) and split.server_api_ms == pytest.approx(5.0)
    assert split.queue_ms == 30.0
    assert split.prefill_first_token_ms == pytest.approx(65.0)  # the engine's own: vLLM's time_in_model_prefill
    assert split.delivery_ms == pytest.approx(16.0)
    parts = [ms for _, ms in split_parts(split)]
    assert sum(parts) == pytest.approx(split.client_ttft_ms) and not split.joined and split.clock_note is None


def test_a_span_starting_before_the_send_says_the_clocks_disagree():
    split = split_from_span(120.0, SEND, _span(start_after_send_ms=-40.0, ttft=100.0, queue=0.0, prefill=90.0))
    assert split.clock_note is not None and "40.0 ms before the client sent" in split.clock_note


def test_per_request_metrics_give_durations_so_connection_and_delivery_are_one_figure():
    metrics = VllmRequestMetrics(queue_time_ms=12.0, time_to_first_token_ms=50.0, generation_time_ms=900.0,
                                 mean_itl_ms=9.0, tokens_per_second=110.0)
    split = split_from_vllm_metrics(80.0, metrics)
    assert split.joined and split.connection_http_ms is None and split.delivery_ms is None
    assert split.outside_ms == pytest.approx(18.0)  # 80 - (12 + 50)
    assert sum(ms for _, ms in split_parts(split)) == pytest.approx(80.0)
    assert "connection, HTTP and delivery together" in split_line(split)
    over = split_from_vllm_metrics(40.0, metrics)
    assert over.clock_note is not None and "exceeds the client's TTFT" in over.clock_note


def test_llama_progress_gives_the_prompts_start_on_the_clients_clock():
    progress = [PromptProgress(t_ms=25.0, total=40, cache=0, processed=8, time_ms=5.0),
                PromptProgress(t_ms=50.0, total=40, cache=0, processed=40, time_ms=30.0)]
    split = split_from_llama(70.0, prompt_ms=32.0, progress=progress)
    assert split.connection_http_ms == pytest.approx(20.0)  # 25 - 5: when the prompt began
    assert split.queue_ms is None and split.prefill_first_token_ms == 32.0
    assert split.delivery_ms == pytest.approx(18.0)
    assert sum(ms for _, ms in split_parts(split) if ms is not None) == pytest.approx(70.0)
    alone = split_from_llama(70.0, prompt_ms=32.0)
    assert alone.joined and alone.outside_ms == pytest.approx(38.0)
    # A progress chunk that reached the client late leaves no room for delivery: the start moves back.
    late = split_from_llama(70.0, prompt_ms=32.0, progress=[PromptProgress(45.0, 40, 0, 8, 5.0)])
    assert late.connection_http_ms == pytest.approx(38.0) and late.delivery_ms == 0.0 and late.clock_note is None


def test_the_finest_report_wins():
    metrics = VllmRequestMetrics(10.0, 40.0, None, None, None)
    span = _span(2.0, 55.0, 10.0, 40.0)
    assert best_split(70.0, SEND, span=span, vllm_metrics=metrics).source.startswith("vLLM span")
    assert best_split(70.0, SEND, vllm_metrics=metrics).source == "vLLM per-request metrics"
    assert best_split(None, SEND, vllm_metrics=metrics) is None  # no first token, nothing to split


def _sample(t: float, waiting: float = 0, preemptions: float = 0, prompts: float = 0) -> BatchSample:
    return BatchSample(t_ms=t, source="vLLM /metrics", running=1, waiting=waiting,
                       preemptions_total=preemptions, prompt_tokens_total=prompts)


def test_a_spike_is_marked_with_what_the_batch_did_between_the_polls_around_it():
    chunks = [100.0 + 10 * i for i in range(10)] + [300.0] + [310.0 + 10 * i for i in range(5)]
    samples = [_sample(90.0), _sample(150.0), _sample(250.0, waiting=3, preemptions=1, prompts=4100),
               _sample(400.0, waiting=3, preemptions=1, prompts=4100)]
    marks = spike_marks(chunks, samples)
    assert [m.chunk for m in marks] == [10]  # the 110 ms gap, 11x the 10 ms median
    reason = marks[0].reason
    assert "waiting rose 0→3" in reason and "a preemption" in reason and "+4,100 prompt tokens" in reason


def test_no_spike_in_an_even_stream_and_no_claim_without_polls():
    even = [10.0 * i for i in range(20)]
    assert spike_marks(even, []) == []
    spiky = even + [400.0, 410.0, 420.0]
    assert spike_marks(spiky, [])[0].reason == "no poll of the batch around it"


def test_each_view_left_off_names_its_flag():
    vllm = ServerView(ServerKind(VLLM, "0.32.0", "http://h"), "id", SEND)
    flags = [o.flag for o in off_views(vllm, cached_reported=False, otlp_listen=None)]
    assert flags == ["--enable-per-request-metrics", "--otlp-traces-endpoint", "--enable-prompt-tokens-details"]
    waited = off_views(vllm, cached_reported=True, otlp_listen="127.0.0.1:4318", span_wait_s=15)
    assert "none arrived in 15 s" in waited[1].view and "http://127.0.0.1:4318/v1/traces" in waited[1].how
    llama = ServerView(ServerKind(LLAMA_SERVER, None, "http://h"), "id", SEND)
    lines = [o.line() for o in off_views(llama, cached_reported=True, otlp_listen=None, metrics_off=True,
                                         slots_off=True)]
    assert lines == ["the batch (requests processing, deferred): off; start llama-server with --metrics",
                     "the slots (each one's task and tokens): off; start llama-server without --no-slots"]


def test_a_poll_long_after_the_spike_is_not_taken_as_its_cause():
    chunks = [10.0 * i for i in range(20)] + [400.0, 410.0, 420.0]
    samples = [_sample(0.0), _sample(50.0), _sample(100.0), _sample(2000.0, waiting=5)]
    assert spike_marks(chunks, samples)[0].reason == "no poll of the batch around it"
