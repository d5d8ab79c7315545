"""The stages before the sampler's filters: logit bias and the penalties, against their references.

- repetition_penalty against transformers' own `RepetitionPenaltyLogitsProcessor`;
- frequency and presence penalties against vLLM's `apply_penalties`, written out on the whole row;
- logit bias, and the order: bias, then repetition, frequency, presence, then the filters
  (temperature first in the default order), with values chosen so that any other order differs;
- a plain request's row passes untouched (the hot path does nothing), min_tokens' mask, and the
  trace's record of what the stages did.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from minengine.sampling.chain import filter_logits
from minengine.sampling.logit_stages import LogitStages
from minengine.sampling.params import SamplingParams
from minengine.sampling.sampler import Sampler

VOCAB = 4096
NEG_INF = float("-inf")


def piece(token_id: int) -> str:
    return f"<{token_id}>"


def stages_for(params: SamplingParams, prompt=(), output=(), **kwargs) -> LogitStages:
    stages = LogitStages(Sampler(params), piece, prompt_ids=prompt, **kwargs)
    for token in output:
        stages.accept(token)
    return stages


def random_case(seed: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Logits with both signs, a prompt and an output that repeat ids and share some."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(VOCAB, generator=g) * 4
    prompt = torch.randint(0, 300, (60,), generator=g).tolist()
    output = torch.randint(200, 500, (40,), generator=g).tolist()
    return row, prompt, output


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_equals_transformers_processor(penalty, seed):
    row, prompt, output = random_case(seed)
    params = SamplingParams(repetition_penalty=penalty)
    ours = stages_for(params, prompt, output).adjust(row, params)
    # transformers sees the prompt and the output as one sequence of input ids.
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), row.clone()[None])[0]
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, row)  # the case really penalised something


@pytest.mark.parametrize(("frequency", "presence"), [(0.5, 0.0), (0.0, 1.5), (-0.8, 0.6), (2.0, -2.0)])
def test_frequency_and_presence_follow_vllm_over_the_output_only(frequency, presence):
    row, prompt, output = random_case(3)
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    ours = stages_for(params, prompt, output).adjust(row, params)
    # vLLM's apply_penalties, with output_bin_counts and output_mask over the whole vocabulary.
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB)
    expected = row.clone()
    expected -= frequency * counts
    expected -= presence * (counts > 0)
    assert torch.allclose(ours, expected, rtol=0, atol=1e-5)
    only_prompt = sorted(set(prompt) - set(output))
    assert torch.equal(ours[only_prompt], row[only_prompt])  # prompt tokens are not counted


def test_logit_bias_adds_to_the_named_tokens_only():
    row, _, _ = random_case(4)
    params = SamplingParams(logit_bias=((7, 100.0), (9, -100.0), (4000, 2.5)))
    ours = stages_for(params).adjust(row, params)
    expected = row.clone()
    expected[7] += 100.0
    expected[9] -= 100.0
    expected[4000] += 2.5
    assert torch.equal(ours, expected)
    assert Sampler(params.with_(temperature=0)).sample(ours) == 7


def test_the_order_is_bias_then_repetition_then_frequency_then_presence_then_temperature():
    row = torch.zeros(8)
    row[1], row[2] = -1.0, 1.0
    params = SamplingParams(
        temperature=0.5, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.25, logit_bias=((1, 2.0),)
    )
    stages = stages_for(params, prompt=(1,), output=(2, 2))
    adjusted = stages.adjust(row, params)
    # token 1: bias first (-1 + 2 = 1), then the repetition penalty divides (0.5). Penalty first would give 0.
    assert adjusted[1].item() == 0.5
    # token 2: repetition first (1 / 2), then frequency (- 1 * 2), then presence (- 0.25): -1.75.
    # Frequency first would give (1 - 2 - 0.25) * 2 = -2.5.
    assert adjusted[2].item() == -1.75
    # Then the filter chain, temperature first in the default order: divided by 0.5.
    scores, _ = filter_logits(adjusted, params)
    assert scores[1].item() == 1.0 and scores[2].item() == -3.5


def test_a_plain_request_samples_from_the_models_own_row():
    row, prompt, output = random_case(5)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    stages = stages_for(params, prompt, output)
    assert stages.adjust(row, params) is row  # no copy, no pass over the row
    adjusted, adjustments = stages.adjust_traced(row, params, 20)
    assert adjusted is row and adjustments is None
    token, trace = stages.pick(row, traced=True)
    assert trace.adjustments is None and stages.count == len(output) + 1


def test_min_tokens_masks_the_end_tokens_until_enough_are_out():
    row = torch.zeros(16)
    row[3] = 5.0  # the end token is the most likely
    params = SamplingParams(temperature=0)
    stages = stages_for(params, end_ids=(3, 11), min_tokens=2)
    first, trace = stages.pick(row, traced=True)
    assert first != 3 and trace.adjustments.min_tokens_masked == 2
    assert trace.adjustments.winner_before == 3 and trace.adjustments.winner_after == first
    assert stages.pick(row, traced=False)[0] != 3
    assert stages.pick(row, traced=False)[0] == 3  # two are out: the mask is gone
    assert math.isfinite(row[3].item())  # the model's own row was never changed


def test_the_trace_names_the_tokens_whose_rank_the_penalties_moved():
    row = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias=((4, 3.5),))
    stages = stages_for(params, prompt=(0,))
    token, trace = stages.pick(row, traced=True, top_n=3)
    adjustments = trace.adjustments
    # Token 0 falls from 4.0 to 2.0 (tied with token 2: both third); token 4 rises from 0.0 to 3.5
    # and wins; token 1 keeps its second place and is not named.
    assert token == 4 and adjustments.winner_before == 0 and adjustments.winner_after == 4
    moved = {c.token_id: (c.rank_before, c.rank_after) for c in adjustments.changes}
    assert moved == {4: (5, 1), 0: (1, 3)}
    assert adjustments.changes[0].token_id == 4 and adjustments.changes[0].logit_after == 3.5
    assert adjustments.grammar is None
    # The trace's candidates are what the filters saw: after the stages.
    assert trace.candidates[0].token_id == 4 and trace.candidates[0].logit == 3.5


def test_a_forced_token_is_counted_like_a_sampled_one():
    row = torch.zeros(8)
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    stages = stages_for(params)
    assert stages.pick(row, traced=False, force=5)[0] == 5
    assert stages.adjust(row, params)[5].item() == -1.0


def test_greedy_decode_under_a_repetition_penalty_equals_transformers_generate(chatty_tiny_dir, chatty_engine):
    from transformers import AutoModelForCausalLM

    from minengine.engine.events import DoneEvent
    from minengine.engine.request import GenerationRequest
    from minengine.reference.generate import generate
    from minengine.reference.model import ReferenceModel
    from minengine.text.chat_template import Message
    from minengine.text.tokenizer import ModelTokenizer

    params = SamplingParams(temperature=0, repetition_penalty=1.8)
    model, tok = ReferenceModel.load(chatty_tiny_dir), ModelTokenizer(chatty_tiny_dir)
    # A prompt holding the model's own greedy words, so that the penalty over the prompt decides.
    plain_answer = generate(model, tok, "Hello", max_tokens=12)  # the reference loop: greedy, no penalty
    echo = "Hello" + tok.decode([s.token for s in plain_answer])
    ids = tok.encode(tok.render([Message("user", echo)]))
    hf = AutoModelForCausalLM.from_pretrained(chatty_tiny_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        prompt, greedy = torch.tensor([ids]), {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None}
        want = hf.generate(prompt, repetition_penalty=1.8, pad_token_id=0, **greedy)[0, len(ids) :].tolist()
        plain = hf.generate(prompt, pad_token_id=0, **greedy)[0, len(ids) :].tolist()
    assert want[0] != plain[0]  # the penalty changed the first token: one the prompt holds
    request = GenerationRequest.from_prompt(echo, sampling=params, max_tokens=12, trace=False, ignore_eos=True)
    result = next(e for e in chatty_engine.generate(request) if isinstance(e, DoneEvent)).result
    assert list(result.token_ids) == want
