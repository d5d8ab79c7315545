"""The generation loop, read second: template, tokens, prefill, then one decode step per token.

It runs outside the engine on any model folder, and a reader can step through it in a debugger
(greedy, at most MAX_TOKENS tokens; `generate` takes any sampling parameters):

    python -m minengine.reference.generate MODEL_DIR "Show me wheelchair-accessible hotels in Kyoto" [MAX_TOKENS]

The chat template, tokenizer and sampler chain are the engine's own readable modules; only the
model's arithmetic is the reference's (`minengine.reference.model`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from minengine.errors import ReqscopeError
from minengine.reference.model import ReferenceModel
from minengine.sampling.logit_stages import LogitStages
from minengine.sampling.params import SamplingParams
from minengine.sampling.sampler import Sampler
from minengine.text.chat_template import Message
from minengine.text.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class Step:
    """One generated token: its id, and the text the whole answer reads as once it is added."""

    token: int
    text: str


def generate(
    model: ReferenceModel,
    tokenizer: ModelTokenizer,
    prompt: str,
    params: SamplingParams,
    max_tokens: int = 128,
) -> Iterator[Step]:
    """Answer `prompt` as a one-message chat, yielding each sampled token as it is decided."""
    text = tokenizer.render([Message("user", prompt)])  # the chat template, as the model was trained
    ids = tokenizer.encode(text)  # the token ids prefill runs over
    cache = model.new_cache(len(ids) + max_tokens)  # room for the prompt and every answer token
    # The stages before the filters (logit bias, the penalties over the prompt and the answer) and the sampler.
    stages = LogitStages(Sampler(params, model.device), tokenizer.piece, prompt_ids=ids)
    # Prefill: every prompt position in one forward, their K/V cached; the last one's logits.
    logits = model.forward(torch.tensor(ids, device=model.device), 0, cache)
    answer: list[int] = []
    for position in range(len(ids), len(ids) + max_tokens):
        token, _ = stages.pick(logits, traced=False)  # bias, penalties, then temperature, top-k, top-p, min-p, a draw
        if token in tokenizer.eos_ids:
            return
        answer.append(token)
        yield Step(token, tokenizer.decode(answer))
        # Decode: the new token alone, attending over every cached position before it.
        logits = model.forward(torch.tensor([token], device=model.device), position, cache)


def main(argv: list[str] | None = None) -> int:
    """Stream a greedy answer to standard output: MODEL_DIR PROMPT [MAX_TOKENS]."""
    parser = argparse.ArgumentParser(description="The reference model's generation loop, outside the engine (greedy).")
    parser.add_argument("model_dir", help="a Hugging Face model folder (config.json, safetensors, tokenizer.json)")
    parser.add_argument("prompt")
    parser.add_argument("max_tokens", nargs="?", type=int, default=128, help="the most tokens to generate (128)")
    args = parser.parse_args(argv)
    try:
        model = ReferenceModel.load(args.model_dir)
        tokenizer = ModelTokenizer(Path(args.model_dir))
    except ReqscopeError as exc:  # a folder that is not a model: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = ""
    for step in generate(model, tokenizer, args.prompt, SamplingParams(temperature=0), args.max_tokens):
        sys.stdout.write(step.text[len(shown) :])  # only what this token added
        sys.stdout.flush()
        shown = step.text
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
