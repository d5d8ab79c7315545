"""The generation loop, read second: template, tokens, prefill, then one decode step per token.

It runs outside the engine on any model folder, and a reader can step through it in a debugger
(greedy, at most MAX_TOKENS tokens; `generate` takes a temperature, top-k, top-p and seed):

    python -m minengine.reference.generate MODEL_DIR "Show me wheelchair-accessible hotels in Kyoto" [MAX_TOKENS]

The chat template and the tokenizer are the engine's own readable modules; the model's arithmetic
(`minengine.reference.model`) and the sampler (`sample`, below) are the reference's.
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
from minengine.text.chat_template import Message
from minengine.text.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class Step:
    """One generated token: its id, and the text the whole answer reads as once it is added."""

    token: int
    text: str


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """One token from next-token logits [V]: the argmax at temperature 0, else a draw after
    temperature, top-k (0: off) and top-p (1: off), each as Hugging Face's warper of that name.

    The draw is the engine's (`minengine.sampling.sampler`): one float64 uniform from `generator`
    per token, found in the cumulative probabilities in token-id order, so the same seed draws the
    same tokens. The engine takes the softmax over the survivors only, this one over the whole
    row: the probabilities may differ in the last bit, and a uniform that close to a boundary
    could pick its neighbour.
    """
    if temperature == 0:
        return int(logits.argmax())
    scores = logits.float() / temperature
    if 0 < top_k < scores.numel():  # keep the k best, and every score tied with the k-th
        scores = scores.masked_fill(scores < scores.topk(top_k).values[-1], float("-inf"))
    if top_p < 1:  # drop the least likely while what they hold together stays within 1 - top_p
        ascending, order = scores.sort()
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        dropped[-1] = False  # the most likely token always stays
        scores[order[dropped]] = float("-inf")
    cdf = scores.softmax(-1).cumsum(0, dtype=torch.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(token, int(torch.searchsorted(cdf, cdf[-1])))  # u * total rounded up to total: the last live token


def generate(
    model: ReferenceModel,
    tokenizer: ModelTokenizer,
    prompt: str,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_tokens: int = 128,
) -> Iterator[Step]:
    """Answer `prompt` as a one-message chat, yielding each sampled token as it is decided."""
    text = tokenizer.render([Message("user", prompt)])  # the chat template, as the model was trained
    ids = tokenizer.encode(text)  # the token ids prefill runs over
    cache = model.new_cache()
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on any device
    # Prefill: every prompt position in one forward, their K/V cached; the last one's logits.
    logits = model.forward(torch.tensor(ids, device=model.device), 0, cache)
    answer: list[int] = []
    for position in range(len(ids), len(ids) + max_tokens):
        token = sample(logits.cpu(), temperature, top_k, top_p, generator)
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
    for step in generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens):
        sys.stdout.write(step.text[len(shown) :])  # only what this token added
        sys.stdout.flush()
        shown = step.text
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
