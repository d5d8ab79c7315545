"""Rebuild a Hugging Face `tokenizer.json` and `tokenizer_config.json` from GGUF metadata.

A GGUF keeps the byte-level BPE vocabulary, the merge ranks and a token type per id, but not
the pre-tokenizer: it only names it (`tokenizer.ggml.pre`). Each supported name is mapped to
the splitting rules the original tokenizer.json used, so the ids come out the same.
"""

from __future__ import annotations

from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from minengine.errors import TokenizerError
from minengine.gguf.metadata import GGUFMetadata

# Split patterns of the tokenizers that GGUF names by `tokenizer.ggml.pre`. They differ only
# in how digits group: Qwen2 takes one digit per piece, llama3 up to three.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

SUPPORTED_PRE_TOKENIZERS = ("smollm", "qwen2", "llama-bpe", "gpt2")


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE tokenizer."""
    kind = meta.get_str("tokenizer.ggml.model", "none")
    if kind != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') "
            "tokenizers can be rebuilt"
        )
    style = meta.get_str("tokenizer.ggml.pre", "default")
    if style not in SUPPORTED_PRE_TOKENIZERS:
        raise TokenizerError(
            f"GGUF pre-tokenizer {style!r} is not supported (known: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}); its token ids could not be reproduced"
        )
    tokens = meta.get_list("tokenizer.ggml.tokens")
    types = meta.get_list("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get_list("tokenizer.ggml.merges", [])]
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)

    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=style == "llama-bpe",
        )
    )
    _set_splitting(tokenizer, style)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(_added_tokens(tokens, types, special=False))
    tokenizer.add_special_tokens(_added_tokens(tokens, types, special=True))
    tokenizer.post_processor = _post_processor(meta, tokens)
    return tokenizer


def tokenizer_config(meta: GGUFMetadata, model_max_length: int) -> dict[str, Any]:
    """The content of tokenizer_config.json: special token strings and the chat template."""
    tokens = meta.get_list("tokenizer.ggml.tokens")

    def token_at(key: str) -> str | None:
        token_id = meta.get_int(key, None)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": meta.get_bool("tokenizer.ggml.add_bos_token", False),
        "add_eos_token": meta.get_bool("tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if meta.has("tokenizer.chat_template"):
        config["chat_template"] = meta.get_str("tokenizer.chat_template")
    return config


def _set_splitting(tokenizer: Tokenizer, style: str) -> None:
    if style == "smollm":
        tokenizer.pre_tokenizer = pre.Sequence(
            [
                pre.Digits(individual_digits=True),
                pre.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif style == "gpt2":
        tokenizer.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pattern = _QWEN2_SPLIT if style == "qwen2" else _LLAMA3_SPLIT
        if style == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(pattern), behavior="isolated", invert=False),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )


def _added_tokens(tokens: list[str], types: list[int], *, special: bool) -> list[AddedToken]:
    # Control tokens (<|im_end|>, ...) are special: never split, skipped when decoding with
    # skip_special_tokens. User-defined ones are matched whole but decode as text.
    wanted = TokenType.CONTROL if special else TokenType.USER_DEFINED
    return [
        AddedToken(token, special=special, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind == wanted
    ]


def _post_processor(meta: GGUFMetadata, tokens: list[str]) -> processors.PostProcessor:
    bos_id = meta.get_int("tokenizer.ggml.bos_token_id", None)
    if meta.get_bool("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        return processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return processors.ByteLevel(trim_offsets=False)
