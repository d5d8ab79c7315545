"""The default model's attention and logit lens through a real request, against transformers.

SmolLM2-135M-Instruct (GQA, 30 layers, 9 query heads over 3 KV heads), float32 on the CPU, greedy:
the records of the prefill's last position and of decode steps after it, against
`output_attentions=True` (eager) and `output_hidden_states=True` through `model.norm` and `lm_head`
on the same tokens. Tolerances: weights and entropies 1e-4 absolute (nats for entropies), lens
probabilities 1e-4 absolute (the model's logits agree to 1e-3). With FP8 K/V, whose rounding
accumulates over the 30 layers (measured: median weight error 0.004, largest 0.11, entropies
within 0.22 nats), the median error of the top weights within 0.01, the largest within 0.15,
entropies within 0.3 nats.
"""

from __future__ import annotations

import math

import pytest
import torch

from minengine.engine.events import PromptEvent, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.inspect.ask import InspectAsk
from minengine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow
KYOTO = "Show me wheelchair-accessible hotels in Kyoto"
CHECKED = (0, 3, 7)  # tokens whose step is compared: prefill's last position, then decode steps
ATOL = 1e-4
FP8_MEDIAN, FP8_MAX, FP8_ENTROPY = 0.01, 0.15, 0.3


@pytest.fixture(scope="module")
def hf_eager(default_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _run(engine, kv_dtype="auto", layout="gqa"):
    req = GenerationRequest.from_prompt(
        KYOTO, sampling=SamplingParams(temperature=0.0), max_tokens=8, kv_dtype=kv_dtype, kv_layout=layout
    )
    session = engine.start(req)
    session.inspect(InspectAsk(attention_top=5, lens="vocab"))
    prompt, tokens, on_demand = [], {}, None
    for event in session:
        if isinstance(event, PromptEvent):
            prompt = [p.token_id for p in event.pieces]
        if isinstance(event, StepReady) and event.index == 5:
            on_demand = session.inspect_step()
        if isinstance(event, TokenEvent):
            tokens[event.index] = event
    return prompt, tokens, on_demand


def _reference(hf, fed):
    ids = torch.tensor([fed])
    with torch.no_grad():  # an explicit mask: the prompt's <|im_end|> is the pad token
        return hf(ids, attention_mask=torch.ones_like(ids), output_attentions=True, output_hidden_states=True)


def _check_attention(attention, ref, pos, atol):
    assert attention.query_position == pos and attention.kv_heads == 3 and attention.q_heads == 9
    for layer in attention.layers:
        theirs = ref.attentions[layer.layer][0, :, pos, : pos + 1]
        for head in layer.heads:
            row = theirs[head.head]
            assert head.kv_head == head.head // 3
            for a in head.top:
                assert abs(a.weight - float(row[a.position])) < atol
            assert head.top[0].weight == pytest.approx(float(row.max()), abs=atol)
            entropy = float(-(row * row.clamp_min(1e-30).log()).sum())
            assert head.entropy == pytest.approx(entropy, abs=max(atol, 10 * atol * math.log(pos + 1)))


def test_attention_and_lens_match_transformers(default_engine, hf_eager):
    prompt, tokens, on_demand = _run(default_engine)
    fed = prompt + [tokens[i].token_id for i in sorted(tokens)]
    ref = _reference(hf_eager, fed)
    last = default_engine.cfg.num_hidden_layers - 1
    for index in CHECKED:
        pos = len(prompt) - 1 + index
        inspection = tokens[index].inspection
        _check_attention(inspection.attention, ref, pos, ATOL)
        hidden = ref.hidden_states
        with torch.no_grad():
            normed = [hf_eager.model.norm(hidden[i + 1][0, pos]) for i in range(last)] + [hidden[-1][0, pos]]
            probs = hf_eager.lm_head(torch.stack(normed)).softmax(-1)
        chosen = tokens[index].token_id
        for layer in inspection.lens.layers:
            p = probs[layer.layer]
            assert layer.top_token == int(p.argmax()) or p[layer.top_token] == pytest.approx(float(p.max()), abs=ATOL)
            assert layer.top_prob == pytest.approx(float(p.max()), abs=ATOL)
            assert layer.chosen_prob == pytest.approx(float(p[chosen]), abs=ATOL)
        assert inspection.lens.layers[-1].chosen_rank == 1
    # The held step's on-demand views: the same step, its strip the heads' mean over every position.
    pos = len(prompt) - 1 + 5
    _check_attention(on_demand.attention, ref, pos, ATOL)
    for layer in on_demand.attention.layers:
        mean = ref.attentions[layer.layer][0, :, pos, : pos + 1].mean(0)
        assert torch.allclose(torch.tensor(layer.strip.weights), mean, atol=ATOL)


def test_mha_layout_attention_matches_transformers(default_engine, hf_eager):
    prompt, tokens, _ = _run(default_engine, layout="mha")
    ref = _reference(hf_eager, prompt + [tokens[i].token_id for i in sorted(tokens)])
    for index in CHECKED:
        attention = tokens[index].inspection.attention
        assert attention.layout == "mha" and attention.kv_heads == 9 and attention.group_size == 1
        assert [h.kv_head for h in attention.layers[0].heads] == list(range(9))
        pos = len(prompt) - 1 + index
        for layer in attention.layers:
            theirs = ref.attentions[layer.layer][0, :, pos, : pos + 1]
            for head in layer.heads:
                assert all(abs(a.weight - float(theirs[head.head, a.position])) < ATOL for a in head.top)


def test_fp8_kv_attention_is_near_transformers(default_engine, hf_eager):
    prompt, tokens, _ = _run(default_engine, kv_dtype="fp8")
    ref = _reference(hf_eager, prompt + [tokens[i].token_id for i in sorted(tokens)])
    for index in CHECKED:
        pos = len(prompt) - 1 + index
        errors, entropies = [], []
        for layer in tokens[index].inspection.attention.layers:
            theirs = ref.attentions[layer.layer][0, :, pos, : pos + 1]
            for head in layer.heads:
                row = theirs[head.head]
                errors += [abs(a.weight - float(row[a.position])) for a in head.top]
                entropies.append(abs(head.entropy - float(-(row * row.clamp_min(1e-30).log()).sum())))
        assert sorted(errors)[len(errors) // 2] < FP8_MEDIAN and max(errors) < FP8_MAX
        assert max(entropies) < FP8_ENTROPY
