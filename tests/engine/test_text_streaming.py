"""Incremental detokenization and stop strings, with the real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minengine.text.detokenizer import IncrementalDetokenizer
from minengine.text.stop import StopMatcher
from minengine.text.tokenizer import ModelTokenizer

TEXTS = [
    "Kyoto's 京都 onsen ♨️ hotels: ¥20,000 per night 🏨🦽",
    "plain ascii with numbers 1234567890 and symbols {}[]()",
    "naïve café — “quotes” … 日本語のテキスト",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return ModelTokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_decode_equals_whole_decode_and_never_breaks_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer.tok)
    chunks = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)
    # Multi-byte characters really were split across tokens in at least one case.
    if "京" in text:
        assert any(c == "" for c in chunks[:-1])


@pytest.mark.parametrize(
    ("pieces", "stops", "expected_text", "matched"),
    [
        (["Hello", " wor", "ld", "!"], ("world",), "Hello ", True),
        (["Hel", "lo", " there"], ("lo t",), "Hel", True),
        (["a", "b", "c"], ("bd",), "abc", False),
        (["END", "x"], ("END",), "", True),
        (["x<|", "stop", "|>y"], ("<|stop|>",), "x", True),
    ],
)
def test_stop_strings_across_chunks(pieces, stops, expected_text, matched):
    m = StopMatcher(stops)
    out, hit = "", False
    for p in pieces:
        text, hit = m.push(p)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (expected_text, matched)


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="abc ", max_size=30),
    st.lists(st.integers(1, 4), max_size=10),
    st.text(alphabet="abc", min_size=1, max_size=4),
)
def test_stop_string_is_never_emitted_even_partially(text, cuts, stop):
    m = StopMatcher((stop,))
    chunks, pos = [], 0
    for c in cuts + [len(text)]:
        chunks.append(text[pos : pos + c])
        pos += c
    emitted, hit = "", False
    for chunk in chunks:
        out, hit = m.push(chunk)
        emitted += out
        # Whatever was emitted is a prefix of the text and contains no stop string.
        assert stop not in emitted
        if hit:
            break
    if not hit:
        emitted += m.flush()
    expected = text[: text.find(stop)] if stop in text else text
    assert emitted == expected
