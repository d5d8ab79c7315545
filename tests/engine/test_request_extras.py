"""vLLM's request extras in the engine: ignore_eos, min_tokens, stop_token_ids.

The chatty tiny model's greedy output is random tokens that rarely include EOS, so the tests
first take its greedy tokens, then declare one of them EOS (or a stop token) and check what
the request does when it comes up.
"""

from __future__ import annotations

import math

import pytest

from minengine.engine.events import DoneEvent, RequestResult, StepReady
from minengine.engine.request import MAX_STOP_TOKEN_IDS, GenerationRequest, validate
from minengine.errors import RequestError
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "Tell me about Kyoto"
MAX = 10


def run(engine, **kwargs) -> RequestResult:
    kwargs.setdefault("max_tokens", MAX)
    request = GenerationRequest.from_prompt(PROMPT, sampling=GREEDY, trace=False, **kwargs)
    return next(e for e in engine.generate(request) if isinstance(e, DoneEvent)).result


@pytest.fixture(scope="module")
def greedy(chatty_engine) -> tuple[int, ...]:
    """The greedy tokens when no EOS comes up: the reference the others are compared with."""
    result = run(chatty_engine)
    assert result.finish_reason == "length" and len(result.token_ids) == MAX
    return result.token_ids


def first_new(tokens: tuple[int, ...], start: int = 1) -> int:
    """The first index from `start` whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_ignore_eos_decodes_exactly_max_tokens(chatty_engine, greedy, monkeypatch):
    k = first_new(greedy, 2)
    monkeypatch.setattr(chatty_engine.tokenizer, "eos_ids", frozenset({greedy[k]}))
    stopped = run(chatty_engine)
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy[: k + 1]
    ignored = run(chatty_engine, ignore_eos=True)
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == greedy and ignored.usage.completion_tokens == MAX
    assert ignored.text.startswith(stopped.text)  # EOS itself adds no text


def test_min_tokens_masks_eos_until_enough_tokens_are_out(chatty_engine, greedy, monkeypatch):
    eos = greedy[0]  # greedy would end the request at once
    monkeypatch.setattr(chatty_engine.tokenizer, "eos_ids", frozenset({eos}))
    assert run(chatty_engine).token_ids == (eos,)
    held = run(chatty_engine, min_tokens=4)
    assert eos not in held.token_ids[:4] and len(held.token_ids) >= 4
    assert held.finish_reason in ("stop", "length")
    if held.finish_reason == "stop":
        assert held.token_ids[-1] == eos and len(held.token_ids) > 4


def test_min_tokens_leaves_the_waiting_logits_unmasked(chatty_engine, greedy):
    # Logprobs and previews show the model's own logits; only sampling sees the mask.
    request = GenerationRequest.from_prompt(
        PROMPT, sampling=GREEDY, max_tokens=3, trace=False, min_tokens=3, stop_token_ids=(greedy[0],)
    )
    session = chatty_engine.start(request)
    for event in session:
        if isinstance(event, StepReady) and event.index == 0:
            assert math.isfinite(float(session.pending_logits[..., greedy[0]]))
    assert greedy[0] not in session.result.token_ids


def test_min_tokens_keeps_a_stop_string_from_ending_the_request(chatty_engine):
    reference = run(chatty_engine)
    stop = reference.text[:2]
    assert stop.strip(), reference.text
    assert run(chatty_engine, stop=(stop,)).text == ""  # without min_tokens it ends at once
    held = run(chatty_engine, stop=(stop,), min_tokens=MAX)
    assert held.finish_reason == "length" and held.text == reference.text


def test_stop_token_ids_end_with_stop_and_add_no_text(chatty_engine, greedy):
    k = first_new(greedy, 3)
    result = run(chatty_engine, stop_token_ids=(greedy[k], 0))
    assert result.finish_reason == "stop" and result.token_ids == greedy[: k + 1]
    prefix = run(chatty_engine, max_tokens=k)
    assert result.text == prefix.text


def test_stop_token_ids_wait_for_min_tokens(chatty_engine, greedy):
    result = run(chatty_engine, stop_token_ids=(greedy[0],), min_tokens=2)
    assert greedy[0] not in result.token_ids[:2]


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"min_tokens": 11}, "min_tokens must be between 0 and max_tokens (10) (got 11)"),
        ({"min_tokens": -1}, "min_tokens must be between 0"),
        ({"stop_token_ids": (5, -2)}, "stop_token_ids[1] must be a token id"),
        ({"stop_token_ids": (True,)}, "stop_token_ids[0] must be a token id"),
        ({"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS + 1))}, f"at most {MAX_STOP_TOKEN_IDS} ids"),
    ],
)
def test_bad_extras_are_one_line_request_errors(changes, says):
    request = GenerationRequest.from_prompt(PROMPT, max_tokens=MAX, **changes)
    with pytest.raises(RequestError) as caught:
        validate(request)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_stop_token_ids_outside_the_vocabulary_fail_at_the_gateway(chatty_engine):
    vocab = chatty_engine.cfg.vocab_size
    with pytest.raises(RequestError, match=rf"stop_token_ids\[0\] = {vocab} is outside the vocabulary"):
        validate(GenerationRequest.from_prompt(PROMPT, stop_token_ids=(vocab,)), vocab_size=vocab)
    result = run(chatty_engine, stop_token_ids=(vocab,))
    assert result.finish_reason == "error" and "outside the vocabulary" in result.error
    assert result.usage.completion_tokens == 0
