"""Penalties and logit bias through `reqscope serve` on the real default model: greedy output as
transformers' own processors give it (repetition penalty, sequence bias), frequency and presence
as the engine runs them, each changing what an unpenalised request writes."""

from __future__ import annotations

import pytest
import torch
from serve_harness import authorized, chat_body, engine_result, raw_request
from transformers import AutoModelForCausalLM, AutoTokenizer

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.sampling.params import SamplingParams

PROMPT = "Write the word Kyoto five times."  # greedy, the model repeats itself: penalties bite
TOKENS = 10


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine(default_model_dir, device="cpu", dtype="float32", kv_budget_bytes=256 << 20)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    """The same model and tokenizer in transformers: the reference."""
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model_dir)


def served_text(served, **fields) -> str:
    resp = raw_request(served.url, "POST", "/v1/chat/completions",
                       chat_body(PROMPT, max_tokens=TOKENS, temperature=0, **fields), authorized())  # fmt: skip
    assert resp.status == 200, resp.body
    return resp.json()["choices"][0]["message"]["content"]


def hf_text(hf, **generate) -> str:
    model, tok = hf
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=TOKENS, do_sample=False, eos_token_id=2, **generate)
    return tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def test_repetition_penalty_is_transformers_processor(served, hf):
    plain = served_text(served)
    assert plain == hf_text(hf)
    penalised = served_text(served, repetition_penalty=1.8)
    assert penalised == hf_text(hf, repetition_penalty=1.8) and penalised != plain


def test_logit_bias_is_added_to_the_logits(served, hf):
    tok = hf[1]
    plain = served_text(served)
    (favoured,) = tok.encode(" hotel", add_special_tokens=False)
    assert served_text(served, logit_bias={str(favoured): 100}) == " hotel" * TOKENS
    first = tok.encode(plain, add_special_tokens=False)[0]
    banned = served_text(served, logit_bias={str(first): -100})
    assert banned == hf_text(hf, sequence_bias={(first,): -100.0}) and banned != plain


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
def test_frequency_and_presence_penalties_run_as_the_engines(served, engine, field):
    plain = served_text(served)
    penalised = served_text(served, **{field: 2.0})
    reference = engine_result(engine, GenerationRequest.from_prompt(
        PROMPT, sampling=SamplingParams(temperature=0, **{field: 2.0}), max_tokens=TOKENS))  # fmt: skip
    assert penalised == reference.text and penalised != plain
