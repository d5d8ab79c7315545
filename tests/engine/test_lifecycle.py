"""One request's lifecycle on a tiny model with the real tokenizer: stages, stops, cancel, admission."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from minengine.engine.engine import Engine
from minengine.engine.events import AdmitEvent, DoneEvent, PromptEvent, StageEvent, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.session import RequestSession, kv_sizing
from minengine.engine.timeline import ALL_STAGES
from minengine.errors import AdmissionError
from minengine.kv.arithmetic import blocks_for, kv_bytes_in_blocks, stored_kv_heads
from minengine.sampling.params import SamplingParams
from reqscope.wording import worded

GREEDY = SamplingParams(temperature=0.0)


def run(engine, **kwargs):
    req = GenerationRequest.from_prompt(kwargs.pop("prompt", "Tell me about Kyoto"), **kwargs)
    events = list(engine.start(req))
    assert isinstance(events[-1], DoneEvent)
    return events, events[-1].result


def tokens_of(events):
    return [e for e in events if isinstance(e, TokenEvent)]


def test_stages_in_order_and_timeline_reconciles(chatty_engine):
    events, result = run(chatty_engine, sampling=GREEDY, max_tokens=6)
    stages = [e.name for e in events if isinstance(e, StageEvent)]
    assert stages == list(ALL_STAGES)
    names = [e.name for e in result.timeline if e.name != "token"]
    assert names == [
        "client_send",
        "server_arrival",
        "validated",
        "templated",
        "tokenized",
        "scheduler_admit",
        "prefix_cache_start",
        "prefix_cache_end",
        "prefill_start",
        "prefill_end",
        "first_visible_token",
        "last_visible_token",
        "completed",
    ]
    times = [e.t_ms for e in result.timeline]
    assert times == sorted(times)
    assert sum(e.name == "token" for e in result.timeline) == result.usage.completion_tokens
    assert result.finish_reason in ("length", "stop")
    m = result.metrics
    assert m is not None and m.ttft_ms > 0 and m.e2e_ms >= m.ttft_ms
    if m.output_tokens > 1:
        assert m.tpot_ms == pytest.approx((m.e2e_ms - m.ttft_ms) / (m.output_tokens - 1))
        assert m.itl.mean == pytest.approx(m.tpot_ms)


def test_prompt_parts_sum_to_prompt_tokens(chatty_engine):
    events, result = run(chatty_engine, system="You are terse.", sampling=GREEDY, max_tokens=1)
    prompt = next(e for e in events if isinstance(e, PromptEvent))
    parts = {p.name: p.tokens for p in prompt.parts}
    assert sum(parts.values()) == len(prompt.pieces) == result.usage.prompt_tokens
    assert parts["user"] == len(chatty_engine.tokenizer.encode("Tell me about Kyoto"))
    assert parts["system"] == len(chatty_engine.tokenizer.encode("You are terse."))
    assert parts["generation prompt"] >= 2  # <|im_start|>assistant\n
    assert any(p.special for p in prompt.pieces)


def test_a_request_renders_its_chat_template_once(chatty_engine, monkeypatch):
    renders, render = [], chatty_engine.tokenizer.render
    monkeypatch.setattr(chatty_engine.tokenizer, "render", lambda *a, **k: renders.append(k) or render(*a, **k))
    events, _ = run(chatty_engine, sampling=GREEDY, max_tokens=1)
    # One render, with the generation prompt: the default model's template appends a fixed one.
    assert [k.get("add_generation_prompt", True) for k in renders] == [True]
    assert next(e for e in events if isinstance(e, PromptEvent)).parts[-1].name == "generation prompt"


_TURNS = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
_QWEN_STYLE = (
    "{%- for m in messages %}\n{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)


@pytest.mark.parametrize(
    ("template", "fixed"),
    [(_TURNS, ""),  # no generation prompt at all
     (_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n"),
     (_QWEN_STYLE, "<|im_start|>assistant\n"),
     (_TURNS + "{% if add_generation_prompt and messages[-1]['role'] == 'user' %}A:{% endif %}", None),
     (_TURNS + "{% if add_generation_prompt %}A:{% else %}<|endoftext|>{% endif %}", None),
     (_TURNS + "{% if add_generation_prompt %}A:{% endif %}<|end|>", None),  # text after it
     (_TURNS + "{% if add_generation_prompt %}{{ bos_token }}A:{% endif %}", None),  # computed
     ("{% if add_generation_prompt %}[G]{% endif %}" + _TURNS + "{% if add_generation_prompt %}A:{% endif %}", None)],
)  # fmt: skip
def test_the_generation_prompt_is_found_with_one_render_where_the_template_fixes_it(template, fixed):
    from minengine.text.chat_template import Message, fixed_generation_prompt, render_chat

    assert fixed_generation_prompt(template) == fixed
    messages = [Message("system", "Be brief."), Message("user", "hi"), Message("assistant", "yo"), Message("user", "?")]
    rendered, without = (
        render_chat(template, messages, add_generation_prompt=flag, special_tokens={"bos_token": "<s>"})
        for flag in (True, False)
    )
    if fixed is not None:  # what the second render would have told
        assert without + fixed == rendered


def test_stop_string_split_across_tokens_is_never_streamed(chatty_engine):
    events, result = run(chatty_engine, sampling=GREEDY, max_tokens=24)
    pieces = [e.text for e in tokens_of(events)]
    # Pick a stop string that spans the boundary between two non-empty streamed chunks.
    k = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) >= 1 and len(pieces[i]) >= 1)
    before = "".join(pieces[: k - 1])
    stop = pieces[k - 1][-1:] + pieces[k][:1]
    if stop in before:
        pytest.skip("stop string occurs earlier in this model's output")
    events2, result2 = run(chatty_engine, sampling=GREEDY, max_tokens=24, stop=(stop,))
    streamed = "".join(e.text for e in tokens_of(events2))
    assert result2.finish_reason == "stop_sequence"
    assert stop not in streamed
    assert streamed == result2.text == before + pieces[k - 1][:-1]


def test_cancel_from_another_thread_stops_within_one_step(chatty_engine):
    req = GenerationRequest.from_prompt("Count to a thousand", sampling=GREEDY, max_tokens=1000)
    session = chatty_engine.start(req)
    seen = []
    for event in session:
        if isinstance(event, TokenEvent):
            seen.append(event)
            if len(seen) == 5:
                t = threading.Thread(target=session.cancel)
                t.start()
                t.join()
        if isinstance(event, DoneEvent):
            result = event.result
    assert result.finish_reason == "cancelled"
    assert len(seen) <= 6  # at most the step already in flight completes
    assert chatty_engine.scheduler.held_bytes == 0  # KV released


def test_request_over_budget_is_rejected_with_numbers(chatty_tiny_dir):
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 * 1024)
    events, result = run(engine, max_tokens=200)
    assert result.finish_reason == "error"
    assert "MiB of KV, budget 0.1 MiB" in result.error
    assert not tokens_of(events)


def test_request_over_context_is_rejected(chatty_engine):
    _, result = run(chatty_engine, max_tokens=5000)
    assert result.finish_reason == "error" and "exceeds the model's context of 2048" in result.error


def test_second_request_waits_in_queue_until_first_releases(chatty_tiny_dir):
    # One running slot: the second waits for the first. (Admission no longer reserves the worst
    # case, so a budget of one worst case would let the second in beside the first's blocks.)
    req = GenerationRequest.from_prompt("hello", sampling=GREEDY, max_tokens=32)
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=1 << 30, max_num_seqs=1)

    first = engine.start(req)
    it = iter(first)
    for event in it:  # first is admitted and paused at its first step
        if isinstance(event, StepReady):
            break
    result_box = {}

    def second():
        result_box["events"] = list(engine.start(req))

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # waiting in the queue
    for _ in it:
        pass
    thread.join(timeout=30)
    admit = next(e for e in result_box["events"] if isinstance(e, AdmitEvent))
    assert admit.queue_ms >= 250
    done = result_box["events"][-1].result
    assert done.queue_ms == admit.queue_ms
    assert done.metrics.ttft_ms >= admit.queue_ms  # queue wait is part of TTFT


def test_same_seed_same_tokens(chatty_engine):
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=7)
    a = [e.token_id for e in tokens_of(run(chatty_engine, sampling=sampling, max_tokens=16)[0])]
    b = [e.token_id for e in tokens_of(run(chatty_engine, sampling=sampling, max_tokens=16)[0])]
    c = [e.token_id for e in tokens_of(run(chatty_engine, sampling=sampling.with_(seed=8), max_tokens=16)[0])]
    assert a == b
    assert a != c


def test_max_tokens_gives_length_and_usage(chatty_engine):
    events, result = run(chatty_engine, sampling=GREEDY, max_tokens=3)
    assert result.finish_reason in ("length", "stop")
    assert result.usage.completion_tokens == len(tokens_of(events)) <= 3


def test_force_next_token_and_preview(chatty_engine):
    req = GenerationRequest.from_prompt("Tell me about Kyoto", sampling=GREEDY, max_tokens=3)
    session = chatty_engine.start(req)
    forced_id = None
    out = []
    for event in session:
        if isinstance(event, StepReady) and event.index == 1:
            preview = session.preview(SamplingParams(temperature=1.0, top_p=0.5))
            assert preview is not None and preview.candidates
            forced_id = preview.candidates[3].token_id
            session.force_next(forced_id)
        if isinstance(event, TokenEvent):
            out.append(event)
    assert out[1].token_id == forced_id and out[1].forced
    assert out[1].trace.forced


def test_invalid_request_is_an_error_result(chatty_engine):
    _, result = run(chatty_engine, sampling=SamplingParams(temperature=-1.0))
    assert result.finish_reason == "error" and "temperature" in result.error
    with pytest.raises(AdmissionError):
        chatty_engine.scheduler.admit("x", prompt_tokens=10, max_tokens=10, context_limit=15, kv_bytes=1)


def test_every_stage_has_its_own_session_function():
    # The session is written as one function per stage (`_gateway` ... `_complete`).
    assert all(callable(getattr(RequestSession, f"_{stage}", None)) for stage in ALL_STAGES)


def test_kv_reservation_is_whole_blocks_of_stored_heads():
    # The seed's 80-layer GQA model: 327,680 bytes per token; 1,025 + 150 tokens fill 74 blocks of 16.
    assert kv_bytes_in_blocks(80, 8, 128, 2, tokens=1025 + 150, block_size=16) == 74 * 16 * 327_680
    assert kv_bytes_in_blocks(80, 8, 128, 2, tokens=1, block_size=16) == 16 * 327_680
    assert stored_kv_heads("gqa", q_heads=64, kv_heads=8) == 8
    assert stored_kv_heads("mha", q_heads=64, kv_heads=8) == 64


@pytest.mark.parametrize(("layout", "dtype"), [("gqa", "auto"), ("mha", "float8_e4m3fn"), ("gqa", "bfloat16")])
def test_admission_reserves_the_sized_kv(chatty_engine, layout, dtype):
    events, result = run(chatty_engine, sampling=GREEDY, max_tokens=5, kv_layout=layout, kv_dtype=dtype, block_size=8)
    admit = next(e for e in events if isinstance(e, AdmitEvent))
    req = GenerationRequest.from_prompt("x", max_tokens=5, kv_layout=layout, kv_dtype=dtype, block_size=8)
    sizing = kv_sizing(chatty_engine.cfg, chatty_engine.dtype, req, result.usage.prompt_tokens)
    cfg = chatty_engine.cfg
    heads = cfg.num_attention_heads if layout == "mha" else cfg.num_key_value_heads
    elem = {"auto": 4, "float8_e4m3fn": 1, "bfloat16": 2}[dtype]
    tokens = result.usage.prompt_tokens + 5
    assert sizing.tokens == tokens
    assert admit.kv_needed_bytes == sizing.reserved_bytes
    assert sizing.reserved_bytes == blocks_for(tokens, 8) * 8 * 2 * cfg.num_hidden_layers * heads * cfg.head_dim * elem
    assert result.kv_peak.layout == layout and result.kv_peak.stored_heads == heads


def test_consumer_closing_mid_decode_releases_kv(chatty_engine):
    session = chatty_engine.start(GenerationRequest.from_prompt("Tell me", sampling=GREEDY, max_tokens=50))
    it = iter(session)
    for event in it:
        if isinstance(event, StepReady) and event.index == 2:
            assert chatty_engine.scheduler.held_bytes > 0
            break
    it.close()
    assert chatty_engine.scheduler.held_bytes == 0 and chatty_engine.scheduler.running == 0
    assert session.pending_logits is None and session.result is None


def test_out_of_memory_in_decode_reports_what_was_produced(chatty_engine, monkeypatch):
    session = chatty_engine.start(GenerationRequest.from_prompt("Tell me", sampling=GREEDY, max_tokens=20))
    real_forward, calls = session._forward, []

    def forward(ids, start):
        calls.append(start)
        if len(calls) > 3:  # the prompt, then two decode steps
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\ndetails")
        return real_forward(ids, start)

    monkeypatch.setattr(session, "_forward", forward)
    events = list(session)
    result = events[-1].result
    assert result.finish_reason == "error"
    assert worded(result.error) == "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB; lower --max-tokens"
    assert session.failure is None  # only ReqscopeErrors are kept for callers that map them
    assert len(result.token_ids) == len(tokens_of(events)) == 3
    assert result.kv_peak is not None and result.kv_peak.tokens == result.usage.prompt_tokens + 2
    assert [e.name for e in events if isinstance(e, StageEvent)][-1] == "complete"
    assert chatty_engine.scheduler.held_bytes == 0


def test_a_request_cancelled_while_queued_ends_cancelled_with_its_wait(chatty_tiny_dir):
    req = GenerationRequest.from_prompt("hello", sampling=GREEDY, max_tokens=32)
    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=1 << 30, max_num_seqs=1)
    # One running slot: room for one request at a time.
    first = iter(engine.start(req))
    for event in first:  # admitted, and holding its KV at the first step
        if isinstance(event, StepReady):
            break
    waiting = engine.start(req)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("events", list(waiting)))
    thread.start()
    time.sleep(0.3)
    waiting.cancel()  # its client left while it waited
    thread.join(timeout=30)
    done = box["events"][-1].result
    assert (done.finish_reason, done.error) == ("cancelled", None)
    assert done.queue_ms >= 250  # the real wait, not 0
    assert not any(isinstance(e, AdmitEvent) for e in box["events"])
    assert engine.scheduler.waiting == 0
    for _ in first:
        pass
    assert engine.scheduler.held_bytes == 0
