"""`BatchPoller` on the pages real servers sent while other clients streamed (tests/endpoint/recorded_server.py).

Each sample must say what the page it read says. The reference reads the whole page with
prometheus_client's parser (the poller keeps only the lines it wants before parsing) and /slots
with json; the recordings run from an idle server through three streams and back, so the batch
is seen to fill and empty.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from recorded_server import RecordedPage, Replay, replaying

from minengine.engine.timeline import Timeline
from reqscope.endpoint.server.poller import BatchPoller
from reqscope.endpoint.server.records import LLAMA_SERVER, VLLM, BatchSample, ServerKind, SlotState


def _values(page: RecordedPage) -> dict[str, list[float]]:
    """Every sample of a Prometheus page by name, one value per label set."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(page.body):
        for sample in family.samples:
            values.setdefault(sample.name, []).append(sample.value)
    return values


def _sum(values: dict[str, list[float]], name: str) -> float | None:
    return sum(values[name]) if name in values else None


def _slots(page: RecordedPage) -> tuple[SlotState, ...]:
    """llama-server's /slots as the client should hold them: a task and its count only while processing."""
    return tuple(
        SlotState(raw["id"], raw["is_processing"], raw["id_task"] if raw["is_processing"] else None, raw["n_ctx"],
                  raw["next_token"][0]["n_decoded"] if raw["is_processing"] else None)
        for raw in page.json()
    )  # fmt: skip


def _polls(replay: Replay, kind_name: str, count: int) -> tuple[BatchPoller, list[BatchSample | None]]:
    async def run() -> tuple[BatchPoller, list[BatchSample | None]]:
        async with aiohttp.ClientSession() as session:
            kind = ServerKind(kind_name, None, replay.root)
            poller = BatchPoller(session, kind, {}, Timeline(), 50.0, lambda s: None)
            return poller, [await poller.poll() for _ in range(count)]

    return asyncio.run(run())


def test_each_vllm_sample_is_its_metrics_page():
    with replaying("vllm") as replay:
        polls = len(replay.recording.polls)
        _, samples = _polls(replay, VLLM, polls)
        served = replay.served_polls("/metrics")
    assert [s.poll for s in served] == list(range(polls))
    for sample, page in zip(samples, (s.page for s in served), strict=True):
        values = _values(page)
        kv = values["vllm:kv_cache_usage_perc"]
        assert sample.source == "vLLM /metrics" and sample.poll_ms >= 0
        assert sample.running == _sum(values, "vllm:num_requests_running")
        assert sample.waiting == _sum(values, "vllm:num_requests_waiting")
        assert sample.kv_usage == pytest.approx(sum(kv) / len(kv))
        assert sample.preemptions_total == _sum(values, "vllm:num_preemptions_total")
        assert sample.prefix_queries_total == _sum(values, "vllm:prefix_cache_queries_total")
        assert sample.prefix_hits_total == _sum(values, "vllm:prefix_cache_hits_total")
        assert sample.prompt_tokens_total == _sum(values, "vllm:prompt_tokens_total")
    # The recording went from idle through the other clients' streams and back.
    running = [s.running for s in samples]
    assert running[0] == running[-1] == 0 and max(running) >= 1
    assert max(s.kv_usage for s in samples) > 0


def test_each_llama_server_sample_is_its_metrics_and_slots_pages():
    with replaying("llama-server") as replay:
        polls = len(replay.recording.polls)
        _, samples = _polls(replay, LLAMA_SERVER, polls)
        metrics, slots = replay.served_polls("/metrics"), replay.served_polls("/slots")
    assert [s.poll for s in metrics] == [s.poll for s in slots] == list(range(polls))
    for sample, metrics_at, slots_at in zip(samples, metrics, slots, strict=True):
        values, slots_page = _values(metrics_at.page), slots_at.page
        assert sample.source == "llama-server /metrics + /slots"
        assert sample.running == _sum(values, "llamacpp:requests_processing")
        assert sample.waiting == _sum(values, "llamacpp:requests_deferred")
        assert sample.prompt_tokens_total == _sum(values, "llamacpp:prompt_tokens_total")
        assert sample.busy_slots_per_decode == _sum(values, "llamacpp:n_busy_slots_per_decode")
        assert sample.slots == _slots(slots_page)
        # requests_processing counts the slots processing now.
        assert sample.running == sum(s.processing for s in sample.slots)
    running = [s.running for s in samples]
    assert running[0] == running[-1] == 0 and max(running) >= 1
    assert any(s.task is not None and s.decoded is not None for sample in samples for s in sample.slots)


def test_without_metrics_llama_server_is_read_from_its_slots_and_metrics_asked_once():
    with replaying("llama-server-no-metrics") as replay:
        polls = len(replay.recording.polls)
        poller, samples = _polls(replay, LLAMA_SERVER, polls)
        asked = [s.route for s in replay.served]
        slots = [s.page for s in replay.served_polls("/slots")]
    assert asked.count("/metrics") == 1 and asked.count("/slots") == polls  # a 501 is not asked again
    assert poller.metrics_off and not poller.slots_off
    for sample, page in zip(samples, slots, strict=True):
        assert sample.source == "llama-server /slots" and sample.waiting is None
        assert sample.slots == _slots(page)
        assert sample.running == sum(s.processing for s in sample.slots)
    assert max(s.running for s in samples) == 1


def test_a_server_without_metrics_is_asked_once_and_the_poll_ends():
    """llama-cpp-python's server answers /metrics with 404: one try, then nothing left to read."""
    taken: list[BatchSample] = []

    async def run(replay: Replay) -> BatchPoller:
        async with aiohttp.ClientSession() as session:
            poller = BatchPoller(session, ServerKind(VLLM, None, replay.root), {}, Timeline(), 10.0, taken.append)
            await asyncio.wait_for(poller.run(), timeout=10)
            return poller

    with replaying("llama-cpp-python") as replay:
        poller = asyncio.run(run(replay))
    assert poller.metrics_off and taken == []
    assert [s.route for s in replay.served] == ["/metrics"]


def test_run_hands_each_sample_over_in_order_until_cancelled():
    taken: list[BatchSample] = []

    async def run(replay: Replay) -> None:
        async with aiohttp.ClientSession() as session:
            poller = BatchPoller(session, ServerKind(VLLM, None, replay.root), {}, Timeline(), 20.0, taken.append)
            task = asyncio.create_task(poller.run())
            while len(taken) < 4:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with replaying("vllm") as replay:
        asyncio.run(run(replay))
        served = replay.served_polls("/metrics")
    assert len(served) >= 4 and [s.poll for s in served[:4]] == [0, 1, 2, 3]
    times = [s.t_ms for s in taken]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(gap >= 19.5 for gap in gaps), gaps  # the 20 ms interval, then a round trip
    for sample, page in zip(taken, (s.page for s in served), strict=False):
        assert sample.running == _sum(_values(page), "vllm:num_requests_running")

