"""reqscope.endpoint.server.llama against a real llama-server on the default GGUF.

One llama-server with 4 slots, `--metrics` and `--slots` serves the module; two short-lived ones
answer the route-off test: one as llama-server starts by default (/slots on, /metrics off), one
with `--no-slots` as well. All come from scripts/peers/llama-server; where it has not been run the
module skips.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import pytest
from peers import LLAMA_SERVER_SCRIPT, default_gguf, llama_server, llama_server_binary

from reqscope.endpoint.server.llama import (
    LLAMA_METRICS,
    PROGRESS_KEY,
    llama_batch_sample,
    llama_prompt,
    parse_progress,
    parse_slots,
    route_off,
)
from reqscope.endpoint.server.records import BatchSample, PromptProgress, SlotState
from reqscope.endpoint.wire import SSE_DONE, parse_usage, sse_data

if llama_server_binary() is None or default_gguf() is None:
    pytest.skip(f"llama-server or the default GGUF not provisioned: run {LLAMA_SERVER_SCRIPT}", allow_module_level=True)

SLOTS = 4
BATCH = 64  # -b: the prompt is decoded (and its progress sent) in pieces of this many tokens
Chunks = list[tuple[float, dict]]


@pytest.fixture(scope="module")
def root() -> Iterator[str]:
    """The root URL of the module's llama-server (4 slots of 2048 tokens, /metrics and /slots on)."""
    flags = ("-np", str(SLOTS), "-c", str(2048 * SLOTS), "-b", str(BATCH), "--metrics", "--slots")
    with llama_server(*flags) as url:
        yield url


def _messages(question: str) -> list[dict]:
    # A nonce keeps each test's prompt out of the prefix cache the earlier tests filled.
    return [
        {"role": "system", "content": f"You are a terse assistant. Session {uuid.uuid4().hex}."},
        {"role": "user", "content": question},
    ]


async def _stream(session: aiohttp.ClientSession, root: str, body: dict, on_chunk=None) -> Chunks:
    """Every chunk of a streamed chat completion with its arrival in ms from the send;
    `on_chunk(index, chunk)` is awaited after each one."""
    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    chunks: Chunks = []
    sent = time.perf_counter()
    async with session.post(f"{root}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for data in sse_data(resp):
            if data == SSE_DONE:
                break
            chunk = json.loads(data)
            chunks.append(((time.perf_counter() - sent) * 1000, chunk))
            if on_chunk is not None:
                await on_chunk(len(chunks) - 1, chunk)
    return chunks


def _content_at(chunks: Chunks) -> list[int]:
    return [i for i, (_, c) in enumerate(chunks) if c.get("choices") and c["choices"][0]["delta"].get("content")]


def _final_usage(chunks: Chunks) -> dict:
    usage = [c["usage"] for _, c in chunks if isinstance(c.get("usage"), dict)]
    assert usage, "no usage chunk"
    return usage[-1]


def _run(make: Callable[[aiohttp.ClientSession], Awaitable]) -> object:
    async def main() -> object:
        # A connection per request: llama-server closes the connection after every streamed answer
        # (its chunk provider returns false once done, which cpp-httplib takes for a failure)
        # without saying `Connection: close`, so the next request on a pooled one fails at once.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            return await make(session)

    return asyncio.run(main())


def test_prompt_progress_comes_before_the_first_token_and_totals_the_prompt(root: str) -> None:
    long_question = "Summarize these notes. " + " ".join(f"Note {i}: the river rises in spring." for i in range(20))
    body = {"messages": _messages(long_question), "max_tokens": 4, "return_progress": True}
    chunks = _run(lambda s: _stream(s, root, body))
    progress = [(i, p) for i, (t, c) in enumerate(chunks) if (p := parse_progress(c, t)) is not None]
    usage = _final_usage(chunks)

    total = usage["prompt_tokens"]
    assert total > 3 * BATCH
    assert all(isinstance(p, PromptProgress) for _, p in progress)
    assert {p.total for _, p in progress} == {total}
    # One as the slot takes the request, before any of it is decoded; then one per decode of BATCH
    # tokens, all before the first token.
    assert [p.processed for _, p in progress] == [0, *range(BATCH, total, BATCH), total]
    assert progress[0][1].cache == 0 and progress[0][1].time_ms == 0
    steps = [p for _, p in progress]
    assert all(a.time_ms <= b.time_ms and a.t_ms <= b.t_ms for a, b in zip(steps, steps[1:], strict=False))
    assert progress[-1][0] < _content_at(chunks)[0]
    # Progress rides on a role-only delta, never on a token's chunk.
    for i, _ in progress:
        assert chunks[i][1]["choices"][0]["delta"] == {"role": "assistant", "content": None}


def test_a_repeated_prompt_reports_its_cache_in_usage_timings_and_progress(root: str) -> None:
    body = {"messages": _messages("Name three rivers."), "max_tokens": 4, "return_progress": True}

    async def twice(session: aiohttp.ClientSession) -> tuple[Chunks, Chunks]:
        return await _stream(session, root, body), await _stream(session, root, body)

    _, again = _run(twice)
    usage = _final_usage(again)
    timings = [c["timings"] for _, c in again if isinstance(c.get("timings"), dict)][-1]
    first = next(p for t, c in again if (p := parse_progress(c, t)) is not None)

    # All but the last token come from the cache: a slot always decodes at least one.
    assert timings["cache_n"] == usage["prompt_tokens"] - 1
    assert usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]
    assert parse_usage(usage).cached_tokens == timings["cache_n"]
    assert first.cache == first.processed == timings["cache_n"]


def _while_generating(root: str, probe: Callable[[aiohttp.ClientSession], Awaitable]) -> tuple[object, Chunks]:
    """Run `probe` once the streamed request has decoded a few tokens, while it still runs."""
    body = {"messages": _messages("Count from one to fifty in words."), "max_tokens": 48, "ignore_eos": True}
    seen: list[object] = []

    async def main(session: aiohttp.ClientSession) -> Chunks:
        async def on_chunk(index: int, chunk: dict) -> None:
            if not seen and index >= 3:
                seen.append(await probe(session))

        return await _stream(session, root, body, on_chunk)

    chunks = _run(main)
    assert seen, "the request ended before the probe"
    return seen[0], chunks


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as resp:
        return resp.status, await resp.text()


def test_slots_show_the_one_request_that_runs(root: str) -> None:
    async def probe(session: aiohttp.ClientSession) -> tuple[SlotState, ...]:
        status, text = await _get(session, f"{root}/slots")
        assert status == 200
        return parse_slots(json.loads(text))

    slots, chunks = _while_generating(root, probe)
    assert len(slots) == SLOTS and sorted(s.id for s in slots) == list(range(SLOTS))
    busy = [s for s in slots if s.processing]
    assert len(busy) == 1
    assert busy[0].task is not None and busy[0].n_ctx == 2048
    assert busy[0].decoded is not None and 1 <= busy[0].decoded < _final_usage(chunks)["completion_tokens"]

    # Idle again, the slot still names its last task on the wire; parse_slots leaves it out.
    status, text = _run(lambda s: _get(s, f"{root}/slots"))
    assert any("id_task" in raw for raw in json.loads(text))
    assert all(not s.processing and s.task is None and s.decoded is None for s in parse_slots(json.loads(text)))


def test_batch_sample_from_live_metrics_and_slots(root: str) -> None:
    async def probe(session: aiohttp.ClientSession) -> BatchSample:
        started = time.perf_counter()
        (m_status, metrics), (s_status, slots) = await asyncio.gather(
            _get(session, f"{root}/metrics"), _get(session, f"{root}/slots")
        )
        assert (m_status, s_status) == (200, 200)
        poll_ms = (time.perf_counter() - started) * 1000
        return llama_batch_sample(metrics, parse_slots(json.loads(slots)), t_ms=1.0, poll_ms=poll_ms)

    sample, _ = _while_generating(root, probe)
    assert sample.source == "llama-server /metrics + /slots"
    assert sample.running == 1.0 and sample.waiting == 0.0
    assert sample.prompt_tokens_total is not None and sample.prompt_tokens_total > 0
    assert sample.busy_slots_per_decode is not None and sample.busy_slots_per_decode > 0
    assert len(sample.slots) == SLOTS and sample.poll_ms > 0
    assert sample.kv_usage is None  # llama-server exports no KV usage


def test_every_llama_metric_is_on_the_page(root: str) -> None:
    status, text = _run(lambda s: _get(s, f"{root}/metrics"))
    assert status == 200
    names = {line.split()[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert set(LLAMA_METRICS) <= names


def test_llama_prompt_counts_the_tokens_the_request_is_billed(root: str) -> None:
    messages = _messages("Why is the sea salty? Answer in one line.")

    async def both(session: aiohttp.ClientSession):
        prompt = await llama_prompt(session, root, messages, {})
        chunks = await _stream(session, root, {"messages": messages, "max_tokens": 2})
        async with session.post(f"{root}/tokenize", json={"content": prompt.text, "parse_special": False}) as resp:
            literal = (await resp.json())["tokens"]
        return prompt, chunks, literal

    prompt, chunks, literal = _run(both)
    assert len(prompt.token_ids) == _final_usage(chunks)["prompt_tokens"]
    assert prompt.source == "llama-server /apply-template + /tokenize"
    assert prompt.text.startswith("<|im_start|>system\n") and prompt.text.endswith("<|im_start|>assistant\n")
    assert len(prompt.pieces) == len(prompt.token_ids) and "".join(prompt.pieces) == prompt.text
    assert prompt.pieces[0] == "<|im_start|>" and prompt.token_ids[0] == 1  # one special token, its id
    # Read as plain text, each <|im_start|> is 7 tokens (<, |, im, _, start, |, >): the count is wrong.
    assert len(literal) > len(prompt.token_ids)


def test_routes_without_their_flags_answer_501() -> None:
    routes = ("/metrics", "/slots", "/no-such")
    with llama_server("-np", "2") as default:
        (m_status, m_body), (s_status, s_body), (n_status, _) = _run(
            lambda s: asyncio.gather(*(_get(s, default + r) for r in routes))
        )
    with llama_server("-np", "1", "--no-slots") as no_slots:
        s_off_status, s_off_body = _run(lambda s: _get(s, no_slots + "/slots"))

    assert (m_status, s_status, s_off_status, n_status) == (501, 200, 501, 404)
    assert route_off(m_status) and route_off(s_off_status) and not route_off(n_status)
    for body, flag in ((m_body, "--metrics"), (s_off_body, "--slots")):
        error = json.loads(body)["error"]
        assert error["code"] == 501 and error["type"] == "not_supported_error" and flag in error["message"]
    # As llama-server starts by default, a poll has /slots alone: running is its processing slots.
    sample = llama_batch_sample(None, parse_slots(json.loads(s_body)), t_ms=1.0, poll_ms=1.0)
    assert sample.source == "llama-server /slots" and sample.running == 0.0 and len(sample.slots) == 2
    assert sample.waiting is None and sample.prompt_tokens_total is None


def test_progress_key_is_what_the_server_sends(root: str) -> None:
    chunks = _run(lambda s: _stream(s, root, {"messages": _messages("Hi"), "max_tokens": 1, "return_progress": True}))
    assert any(PROGRESS_KEY in c for _, c in chunks)
    plain = _run(lambda s: _stream(s, root, {"messages": _messages("Hi"), "max_tokens": 1}))
    assert not any(PROGRESS_KEY in c for _, c in plain)
