"""The real default model: minengine against transformers on the same converted folder."""

from __future__ import annotations

import pytest
import torch

from minengine.engine.events import DoneEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.kv.cache import KVCache
from minengine.sampling.params import SamplingParams

KYOTO = "Show me wheelchair-accessible hotels in Kyoto"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    return model.eval(), tok


def test_template_renders_like_transformers(default_engine, hf_model):
    _, hf_tok = hf_model
    messages = [{"role": "user", "content": KYOTO}]
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    req = GenerationRequest.from_prompt(KYOTO)
    ours = default_engine.tokenizer.render(list(req.messages))
    assert ours == theirs
    assert default_engine.tokenizer.encode(ours) == hf_tok(theirs, add_special_tokens=False)["input_ids"]


def test_48_greedy_tokens_and_logits_match_transformers(default_engine, hf_model):
    model, hf_tok = hf_model
    req = GenerationRequest.from_prompt(KYOTO, sampling=SamplingParams(temperature=0.0), max_tokens=48)
    ids = default_engine.tokenizer.encode(default_engine.tokenizer.render(list(req.messages)))
    with torch.no_grad():
        # An explicit mask: without it transformers treats the prompt's <|im_end|> (= pad) as padding.
        prompt = torch.tensor([ids])
        ref = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=hf_tok.eos_token_id,
        )[0, len(ids) :].tolist()
        ref_logits = model(torch.tensor([ids])).logits[0].float()

    # Through the whole lifecycle (template, tokenize, prefill, decode), greedy, no stop on eos
    # needed: the reference was told to ignore eos too, so compare only up to our stop.
    events = list(default_engine.start(req))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokens == ref[: len(tokens)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert len(tokens) == 48 or done.result.finish_reason == "stop"

    cache = KVCache(default_engine.cfg, len(ids), device=default_engine.device, compute_dtype=torch.float32)
    ours = default_engine.model.forward(torch.tensor(ids), 0, cache, all_logits=True)
    assert (ours - ref_logits).abs().max().item() < 1e-3


def test_kv_bytes_per_token_follow_the_formula(default_engine):
    req = GenerationRequest.from_prompt(KYOTO, sampling=SamplingParams(temperature=0.0), max_tokens=4)
    events = list(default_engine.start(req))
    kv = [e for e in events if isinstance(e, TokenEvent)][-1].kv
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 head dim x 4 bytes (float32) x 2 (K and V).
    assert kv.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv.logical_bytes == kv.bytes_per_token * kv.tokens
    assert kv.physical_bytes == kv.bytes_per_token * 16 * kv.blocks
