"""A shared step's logit summaries: a greedy trace built from one is the trace its row gives alone.

`logit_summary.summarize` makes, for every row of a step that traces a greedy request, the top
candidates and the displayed softmax in stacked passes on the model thread; `greedy_trace` must
then return exactly what it computes from the row by itself on one thread (the consumer's way).
"""

from __future__ import annotations

import pytest
import torch
from concurrent_runs import run_all

from minengine.engine import step_loop
from minengine.engine.engine import Engine
from minengine.engine.events import TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.sampling import logit_summary
from minengine.sampling.logit_summary import summarize
from minengine.sampling.params import SamplingParams
from minengine.sampling.trace import greedy_trace
from minengine.threads import OneThread

GREEDY = SamplingParams(temperature=0.0)


def piece(token: int) -> str:
    return f"<{token}>"


def _alone(row: torch.Tensor, top_n: int, chosen: int | None = None):
    with OneThread(row.device):
        return greedy_trace(row, GREEDY, chosen, piece, top_n, chosen is not None)


def _rows(count: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stacked = torch.randn(count, vocab, generator=g) * 4
    return list(stacked)  # rows of one tensor, as a step's logits come


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab", [49152, 49155, 1000, 60])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_a_trace_from_the_summary_equals_the_rows_own(threads, vocab, count):
    rows = _rows(count, vocab, seed=vocab + count)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the model thread's count while it summarizes
    try:
        summaries = summarize(rows, 20)
    finally:
        torch.set_num_threads(before)
    assert [s.logits for s in summaries] == rows and all(s.k == min(20, vocab) for s in summaries)
    for row, summary in zip(rows, summaries, strict=True):
        with OneThread(row.device):
            fast = greedy_trace(row, GREEDY, None, piece, 20, False, summary)
            forced = greedy_trace(row, GREEDY, 7, piece, 20, True, summary)
        assert fast is not None and fast == _alone(row, 20)
        assert forced == _alone(row, 20, chosen=7) and forced.chosen_id == 7
        assert fast.chosen_id == int(row.argmax())


def test_rows_with_minus_infinity_and_ties_keep_the_rows_own_answer():
    rows = _rows(3, 4096, seed=3)
    rows[0][::3] = float("-inf")  # masked logits: the entropy takes its fallback sum
    rows[1][:] = 0.5  # every logit tied: the candidates cannot tell, the general path must
    rows[2][100] = float("inf")
    summaries = summarize(rows, 20)
    assert summaries[2].display is None
    for row, summary in zip(rows, summaries, strict=True):
        with OneThread(row.device):
            assert greedy_trace(row, GREEDY, None, piece, 20, False, summary) == _alone(row, 20)
    assert _alone(rows[1], 20) is None


def test_a_summary_of_other_logits_or_another_count_is_not_used():
    a, b = _rows(2, 4096, seed=5)
    (summary,) = summarize([a], 20)
    with OneThread(b.device):
        assert greedy_trace(b, GREEDY, None, piece, 20, False, summary) == _alone(b, 20)
        assert greedy_trace(a.clone(), GREEDY, None, piece, 20, False, summary) == _alone(a, 20)
        assert greedy_trace(a, GREEDY, None, piece, 5, False, summary) == _alone(a, 5)


def test_traced_greedy_requests_in_shared_steps_trace_from_summaries(chatty_tiny_dir, monkeypatch):
    """In the engine: rows summarized together, on the model thread, give each request the trace its
    logits give alone; an untraced request asks for none."""
    made: list[tuple[list[torch.Tensor], list]] = []
    real = step_loop.summarize

    def recording(rows, k):
        out = real(rows, k)
        made.append((list(rows), out))
        return out

    monkeypatch.setattr(step_loop, "summarize", recording)
    used: list[bool] = []
    real_trace = logit_summary.LogitSummary

    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32", kv_budget_bytes=64 << 20, prefix_cache=False)
    prompts = ["Show me hotels in Kyoto", "Explain the KV cache", "A haiku about trains"]
    requests = [
        GenerationRequest.from_prompt(p, sampling=GREEDY, max_tokens=8, ignore_eos=True, top_n=5) for p in prompts
    ]
    together = run_all(engine, requests)
    # Summaries were made for shared steps only: a row alone computes its own.
    assert made and min(len(rows) for rows, _ in made) > 1
    for rows, summaries in made:
        for row, summary in zip(rows, summaries, strict=True):
            assert isinstance(summary, real_trace) and summary.k == 5
            with OneThread(row.device):
                used.append(greedy_trace(row, GREEDY, None, piece, 5, False, summary) == _alone(row, 5))
    assert all(used)
    for events in together:
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) == 8 and all(t.trace is not None and t.trace.chosen_id == t.token_id for t in tokens)
    # Without a trace nothing is summarized; alone, a traced request summarizes its own rows.
    made.clear()
    untraced = [r.with_(trace=False) for r in requests]
    assert all(len([e for e in evs if isinstance(e, TokenEvent)]) == 8 for evs in run_all(engine, untraced))
    alone = list(engine.start(requests[0]))
    assert made == [] and all(e.trace is not None for e in alone if isinstance(e, TokenEvent))


def test_rows_not_end_to_end_are_copied_and_summarized_the_same():
    rows = _rows(5, 49152, seed=11)
    picked = rows[::2]  # a step whose middle rows asked for no summary
    for summary, row in zip(summarize(picked, 20), picked, strict=True):
        assert summary.logits is row
        with OneThread(row.device):
            assert greedy_trace(row, GREEDY, None, piece, 20, False, summary) == _alone(row, 20)
