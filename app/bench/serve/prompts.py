"""The benchmark's prompts: vLLM's random dataset, text of a set number of tokens in the server's tokenizer.

Each prompt is random token ids (special tokens left out) decoded to text. Decoding and
encoding again need not give the same ids back (neighbouring pieces merge), so the ids are cut
or topped up until the text encodes to the length asked for, as vLLM does; a prompt that still
misses by a token or two keeps the length it really has. With a range ratio r, input and output
lengths are drawn uniformly from [L(1 - r), L(1 + r)]; a shared prefix of random tokens, when
asked for, starts every prompt. Everything is drawn from one seeded generator, so a seed gives
the same prompts on every run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from minengine.errors import ReqscopeError
from minengine.text.tokenizer import ModelTokenizer

_FIT_ROUNDS = 10  # re-encodings tried before a prompt keeps the length it has


@dataclass(frozen=True)
class PromptShape:
    """The lengths asked for, in tokens."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0


@dataclass(frozen=True)
class BenchPrompt:
    """One request's prompt: its text, its length in the client's tokenizer, and the tokens to generate."""

    text: str
    prompt_len: int
    output_len: int


def load_tokenizer(folder: Path) -> ModelTokenizer:
    """The tokenizer of a model folder, with an error that says what to pass instead."""
    if not (folder / "tokenizer.json").is_file():
        raise ReqscopeError(
            f"no tokenizer.json in {folder}: pass --tokenizer FOLDER, a model folder with the server's tokenizer"
        )
    return ModelTokenizer(folder)


def random_prompts(tokenizer: ModelTokenizer, shape: PromptShape, count: int, seed: int) -> tuple[BenchPrompt, ...]:
    """`count` prompts of random tokens shaped by `shape`, the same for the same seed."""
    rng = random.Random(seed)
    vocabulary = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids]
    prefix = [rng.choice(vocabulary) for _ in range(shape.prefix_len)]
    prompts = []
    for _ in range(count):
        input_len = max(1, _drawn(rng, shape.input_len, shape.range_ratio))
        output_len = max(1, _drawn(rng, shape.output_len, shape.range_ratio))
        ids = _fitted(tokenizer, rng, vocabulary, prefix, shape.prefix_len + input_len)
        text = tokenizer.decode(ids)
        prompts.append(BenchPrompt(text, len(tokenizer.encode(text)), output_len))
    return tuple(prompts)


def output_lens_from(path: Path, count: int) -> tuple[int, ...]:
    """The tokens each request generated in an earlier run, from its result JSON (`--output FILE`):
    `count` lengths, so that another run's requests generate the same, request by request. A
    request that failed there (length 0) has nothing to match and is refused."""
    try:
        lens = json.loads(path.read_text(encoding="utf-8")).get("output_lens")
    except OSError as exc:
        raise ReqscopeError(f"cannot read --output-lens-from {path}: {exc.strerror or exc}") from None
    except (ValueError, AttributeError):
        raise ReqscopeError(
            f"--output-lens-from {path} is not a bench serve result: pass a file written by --output"
        ) from None
    if not isinstance(lens, list) or not all(isinstance(n, int) for n in lens):
        raise ReqscopeError(f"--output-lens-from {path} has no output_lens list: pass a file written by --output")
    if len(lens) != count:
        raise ReqscopeError(
            f"--output-lens-from {path} holds {len(lens)} requests, not {count}: pass --num-prompts {len(lens)}"
        )
    if any(n <= 0 for n in lens):
        raise ReqscopeError(f"--output-lens-from {path} has failed requests (length 0): use a run with none failed")
    return tuple(lens)


def with_output_lens(prompts: tuple[BenchPrompt, ...], lens: tuple[int, ...]) -> tuple[BenchPrompt, ...]:
    """`prompts` each generating its own length of `lens`, in order."""
    return tuple(replace(prompt, output_len=n) for prompt, n in zip(prompts, lens, strict=True))


def _drawn(rng: random.Random, length: int, ratio: float) -> int:
    low, high = int(length * (1 - ratio)), int(length * (1 + ratio))
    return rng.randint(low, high)


def _fitted(
    tokenizer: ModelTokenizer, rng: random.Random, vocabulary: list[int], prefix: list[int], target: int
) -> list[int]:
    """Ids whose decoded text encodes back to `target` tokens (or as near as the rounds get)."""
    ids = prefix + [rng.choice(vocabulary) for _ in range(target - len(prefix))]
    for _ in range(_FIT_ROUNDS):
        again = tokenizer.encode(tokenizer.decode(ids))
        if len(again) == target:
            return again
        if len(again) > target:
            ids = again[:target]
        else:
            ids = again + [rng.choice(vocabulary) for _ in range(target - len(again))]
    return ids
