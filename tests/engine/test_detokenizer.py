"""The streaming detokenizer over random token sequences of the real vocabulary."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minengine.text.detokenizer import IncrementalDetokenizer
from minengine.text.tokenizer import ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return ModelTokenizer(default_model_dir)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=40))
def test_streamed_text_always_adds_up_to_the_whole_decode(tokenizer, ids):
    # Random ids split characters, start with continuation bytes and include special tokens:
    # whatever is released step by step, plus the flush, is exactly the decode of the whole.
    detok = IncrementalDetokenizer(tokenizer.tok)
    chunks = [detok.push(i) for i in ids]
    chunks.append(detok.flush())
    whole = tokenizer.tok.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) == detok.text == whole
    assert detok.flush() == ""  # a second flush has nothing left


def test_special_tokens_are_skipped_not_printed(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHello<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer.tok)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == "assistant\nHello"
