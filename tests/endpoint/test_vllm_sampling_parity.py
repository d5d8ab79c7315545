"""The whole chain's greedy choices with penalties and logit bias, against the real vLLM CPU build.

vLLM 0.32 runs the float32 default model in bfloat16 on the CPU (its `dtype="auto"` narrows a
float32 checkpoint), so two engines' greedy paths may part where the top two scores are within that
precision of each other. Each request runs on both. Up to the first token where the two differ
they agree by construction; at that token the two choices' adjusted scores must lie within
`BF16_NOISE` of each other, computed here from the reference model in float32 with bias and
penalties applied by their published definitions (written out below, not the engine's code). A
penalty ignored, counted over the prompt where it should count the output only, or applied in
another order parts the paths by far more than that, and fails.

vLLM comes from scripts/peers/vllm (the session's server, tests/endpoint/conftest.py); where it has
not been run, the module skips.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from peers import vllm_python

from minengine.engine.events import DoneEvent
from minengine.engine.request import GenerationRequest
from minengine.reference.model import ReferenceModel
from minengine.sampling.params import SamplingParams

if vllm_python() is None:
    pytest.skip("vLLM is not provisioned: run scripts/peers/vllm", allow_module_level=True)

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_TOKENS = 40
# bfloat16 keeps 8 bits of mantissa: over 30 layers the default model's logits (about 10-25 in
# size) move by up to a few tenths between a bfloat16 and a float32 run.
BF16_NOISE = 0.6

PROMPTS = (
    "List five things to pack for a trip to Kyoto, one per line.",
    "Repeat the word hotel as many times as you can.",
    "Write a short poem about wheelchair-accessible temples.",
)


@dataclass(frozen=True)
class Knobs:
    """One set of the stages before the filters, as the API names them."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def body(self) -> dict:
        out: dict = {
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        if self.logit_bias:
            out["logit_bias"] = {str(i): b for i, b in self.logit_bias}
        return out


def adjusted(logits: torch.Tensor, knobs: Knobs, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Bias, then the repetition penalty over prompt and output (transformers' and vLLM's rule:
    divide a positive logit, multiply a negative one), then frequency and presence over the output
    (OpenAI's definitions)."""
    x = logits.clone()
    for token, bias in knobs.logit_bias:
        x[token] += bias
    seen = sorted(set(prompt) | set(output))
    if knobs.repetition_penalty != 1 and seen:
        ids = torch.tensor(seen)
        x[ids] = torch.where(x[ids] > 0, x[ids] / knobs.repetition_penalty, x[ids] * knobs.repetition_penalty)
    for token, count in Counter(output).items():
        x[token] -= knobs.frequency_penalty * count + knobs.presence_penalty
    return x


def vllm_greedy(root: str, prompt: str, knobs: Knobs) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of vLLM's greedy answer, by its `return_token_ids`."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
        **knobs.body(),
    }
    request = urllib.request.Request(
        root + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    output = list(answer["choices"][0]["token_ids"])
    return list(answer["prompt_token_ids"]), output


def our_greedy(engine, prompt: str, knobs: Knobs) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of the engine's greedy answer under the same knobs."""
    sampling = SamplingParams(
        temperature=0,
        repetition_penalty=knobs.repetition_penalty,
        frequency_penalty=knobs.frequency_penalty,
        presence_penalty=knobs.presence_penalty,
        logit_bias=knobs.logit_bias,
    )
    request = GenerationRequest.from_prompt(prompt, sampling=sampling, max_tokens=MAX_TOKENS, trace=False)
    done = [e for e in engine.generate(request) if isinstance(e, DoneEvent)][-1]
    ids = engine.tokenizer.encode(engine.tokenizer.render(list(request.messages)))
    return list(ids), list(done.result.token_ids)


@pytest.fixture(scope="module")
def reference(default_model_dir) -> ReferenceModel:
    return ReferenceModel.load(default_model_dir)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def gap_at(reference: ReferenceModel, prompt: list[int], output: list[int], at: int, knobs: Knobs, pair) -> float:
    """How far apart the two candidate tokens' adjusted scores are after `output[:at]`."""
    ids = prompt + output[:at]
    cache = reference.new_cache()
    logits = reference.forward(torch.tensor(ids), 0, cache)
    scores = adjusted(logits, knobs, prompt, output[:at])
    return abs(float(scores[pair[0]] - scores[pair[1]]))


def knob_sets(tokenizer) -> tuple[Knobs, ...]:
    hotel = tokenizer.encode(" hotel")[0]
    kyoto = tokenizer.encode(" Kyoto")[0]
    return (
        Knobs(repetition_penalty=1.3),
        Knobs(frequency_penalty=1.2, presence_penalty=0.6),
        Knobs(logit_bias=((hotel, 6.0), (kyoto, -100.0))),
        Knobs(repetition_penalty=0.8, presence_penalty=-0.5, logit_bias=((hotel, 3.0),)),
    )


def test_greedy_choices_with_penalties_and_bias_match_vllm(vllm_server, default_engine, reference):
    tokenizer = default_engine.tokenizer
    changed = 0
    for knobs in knob_sets(tokenizer):
        for prompt in PROMPTS:
            v_prompt, v_out = vllm_greedy(vllm_server.root, prompt, knobs)
            o_prompt, o_out = our_greedy(default_engine, prompt, knobs)
            assert v_prompt == o_prompt, f"the two engines tokenized the chat differently for {prompt!r}"
            _, plain = our_greedy(default_engine, prompt, Knobs())
            changed += plain != o_out
            at = first_difference(v_out, o_out)
            if at is None:
                continue
            gap = gap_at(reference, o_prompt, o_out, at, knobs, (v_out[at], o_out[at]))
            assert gap < BF16_NOISE, (
                f"{knobs} on {prompt!r}: the engines part at token {at} "
                f"({tokenizer.piece(o_out[at])!r} here, {tokenizer.piece(v_out[at])!r} in vLLM) "
                f"with adjusted scores {gap:.3f} apart, beyond bfloat16 noise"
            )
    # The knobs must really steer the answers, or the comparison above proves nothing.
    assert changed >= len(PROMPTS) * 2
