"""Tool calls out of a reply: the Hermes form as vLLM's hermes parser reads it, streamed in pieces
that join to the same result however the text is split."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minengine.text.tool_calls import StreamPiece, ToolCallStream, parse_tool_calls
from minengine.text.tools import Tool

WEATHER = Tool("get_weather", "Current weather", '{"type": "object", "properties": {"city": {"type": "string"}}}')
TIME = Tool("get_time")
TOOLS = (WEATHER, TIME)

ONE_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyoto"}}\n</tool_call>'
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyoto", "days": [1, {"a": "}]"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)


def vllm_hermes_reference(text: str, names: set[str]) -> tuple[str, list[tuple[str, dict]]]:
    """vLLM's hermes parser, non-streaming: every `<tool_call>(.*?)</tool_call>` (or an unclosed
    last one) read as JSON, content the text before the first tag; anything unparsable: all content."""
    if "<tool_call>" not in text:
        return text, []
    try:
        bodies = [a or b for a, b in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)]
        calls = [json.loads(body) for body in bodies]
        found = [(c["name"], c["arguments"]) for c in calls]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []
    if any(name not in names for name, _ in found):
        return text, []
    return text[: text.find("<tool_call>")], found


def streamed(text: str, cuts: list[int], tools=TOOLS, parallel=True) -> tuple[ToolCallStream, list[StreamPiece]]:
    stream = ToolCallStream(tools, parallel)
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [stream.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return stream, [*pieces, stream.finish()]


def joined(pieces: list[StreamPiece]) -> tuple[str, dict[int, tuple[str | None, str | None, str]]]:
    """The content, and per call index (id, name, arguments) from all the deltas."""
    content = "".join(p.content for p in pieces)
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for piece in pieces:
        for d in piece.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, "a call's first delta names it"
                assert re.fullmatch(r"call_[0-9a-f]{24}", d.id)
                calls[d.index] = (d.id, d.name, d.arguments)
            else:
                assert d.id is None and d.name is None, "later deltas carry arguments only"
                cid, name, args = calls[d.index]
                calls[d.index] = (cid, name, args + d.arguments)
    assert list(calls) == list(range(len(calls)))
    return content, calls


# -- whole replies -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        ONE_CALL,
        TWO_CALLS,
        '<tool_call>{"name":"get_time","arguments":{"tz":"Asia/Tokyo"}}</tool_call>',
        'Plain answer, no call: {"name": "get_time"} is just text.',
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
        '<tool_call>{"name": get_time}</tool_call>',
    ],
)
def test_whole_replies_read_as_vllms_hermes_parser_reads_them(text):
    content, calls = parse_tool_calls(text, TOOLS)
    ref_content, ref_calls = vllm_hermes_reference(text, {t.name for t in TOOLS})
    assert content == ref_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == ref_calls


def test_a_call_announced_while_streaming_is_kept_where_vllm_would_give_up():
    # The stream announced the call at its opening; the outer object's missing brace comes too
    # late to take it back, so the whole-reply reader keeps it as well (vLLM's reads it as content).
    text = '<tool_call>\n{"name": "get_time", "arguments": {"a": 1}\n</tool_call>'
    assert vllm_hermes_reference(text, {"get_time"}) == (text, [])
    content, calls = parse_tool_calls(text, TOOLS)
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("get_time", '{"a": 1}')])


def test_content_before_the_first_tag_is_content_and_the_call_is_parsed():
    content, calls = parse_tool_calls(ONE_CALL, TOOLS)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Kyoto"})]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_whitespace_between_and_after_calls_is_not_content():
    content, calls = parse_tool_calls(TWO_CALLS, TOOLS)
    assert content == ""
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Kyoto", "days": [1, {"a": "}]"}]}
    assert calls[0].arguments == '{"city": "Kyoto", "days": [1, {"a": "}]"}]}'  # the model's own text


def test_text_after_a_call_is_content():
    content, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.', TOOLS)
    assert (content, len(calls)) == ("Done.", 1)


def test_an_unknown_name_stays_content_tags_included():
    text = 'Hi <tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, ())


def test_unparsable_text_in_a_tag_stays_content():
    text = '<tool_call>{"name": get_time}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == (text, ())


def test_without_tools_everything_is_content():
    assert parse_tool_calls(ONE_CALL, ()) == (ONE_CALL, ())


def test_parallel_calls_off_keeps_the_first_call_only():
    content, calls = parse_tool_calls(TWO_CALLS, TOOLS, parallel=False)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    stream, pieces = streamed(TWO_CALLS, list(range(len(TWO_CALLS))), parallel=False)
    assert [c.name for c in stream.calls] == ["get_weather"]
    assert list(joined(pieces)[1]) == [0]


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('<tool_call>{"name": "get_weather", "parameters": {"city": "Kyoto"}}</tool_call>', {"city": "Kyoto"}),
        ('<tool_call>{"arguments": {"city": "Kyoto"}, "name": "get_weather"}</tool_call>', {"city": "Kyoto"}),
        ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Kyoto\\"}"}</tool_call>', {"city": "Kyoto"}),
        ('  {"name": "get_weather", "arguments": {"city": "Kyoto"}}', {"city": "Kyoto"}),  # a bare JSON call
        ('{"name": "get_weather", "parameters": {"city": "Kyoto"}}', {"city": "Kyoto"}),
    ],
)
def test_other_forms_are_read(text, arguments):
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", arguments)]


def test_a_bare_json_reply_that_is_not_a_call_is_content():
    text = '{"city": "Kyoto", "stars": 4}'
    assert parse_tool_calls(text, TOOLS) == (text, ())


def test_a_call_cut_off_keeps_what_it_streamed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ky'
    stream, pieces = streamed(text, list(range(len(text))))
    content, calls = joined(pieces)
    assert content == ""
    assert calls[0][1:] == ("get_weather", '{"city": "Ky')
    assert [c.arguments for c in stream.calls] == ['{"city": "Ky']


def test_a_partial_tag_is_held_back_until_known():
    stream = ToolCallStream(TOOLS)
    assert stream.push("Hi <tool").content == "Hi "
    assert stream.push("box>").content == "<toolbox>"
    assert stream.push(" <tool_c").content == " "
    assert stream.finish().content == "<tool_c"
    assert stream.calls == ()


# -- streaming ---------------------------------------------------------------------------------


def test_the_first_delta_names_the_call_and_later_ones_carry_arguments():
    stream = ToolCallStream(TOOLS)
    out = [stream.push(ch) for ch in ONE_CALL] + [stream.finish()]
    deltas = [d for p in out for d in p.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id is not None and deltas[0].index == 0
    assert all(d.name is None and d.id is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"city": "Kyoto"}'
    assert len(deltas) > 5  # streamed piece by piece, not at the end
    first_call_piece = next(i for i, p in enumerate(out) if p.tool_calls)
    assert "".join(p.content for p in out[:first_call_piece]) == "Let me check.\n"
    assert stream.calls[0].id == deltas[0].id


@pytest.mark.parametrize("text", [ONE_CALL, TWO_CALLS, 'Hi <tool_call>{"name": "x", "arguments": {}}</tool_call> ok'])
def test_every_split_point_gives_the_same_result(text):
    whole_content, whole_calls = parse_tool_calls(text, TOOLS)
    expected = [(c.name, c.arguments) for c in whole_calls]
    for cut in range(len(text) + 1):
        stream, pieces = streamed(text, [cut])
        content, calls = joined(pieces)
        assert content == whole_content, cut
        assert [(name, args) for _, name, args in calls.values()] == expected, cut
        assert [(c.name, c.arguments) for c in stream.calls] == expected
        assert [c.id for c in stream.calls] == [cid for cid, _, _ in calls.values()]
    _, pieces = streamed(text, list(range(len(text))))  # one character at a time
    assert joined(pieces)[0] == whole_content


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab <>{}[]"\\/_\n'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("xyz", max_size=3), inner, max_size=3),
    max_leaves=8,
)
_prose = st.text(alphabet="ab <>/_tolc\n{}", max_size=12)


@st.composite
def replies(draw):
    """A reply: optional prose, then calls (known or unknown names) separated by whitespace or prose."""
    prose = draw(_prose)
    while "<tool_call>" in prose:
        prose = prose.replace("<tool_call>", "")
    parts, calls = [prose], []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["get_weather", "get_time", "nope"]))
        args = draw(st.dictionaries(st.text("abc", min_size=1, max_size=3), _json_values, max_size=3))
        body = json.dumps({"name": name, "arguments": args}, indent=draw(st.sampled_from([None, 2])))
        parts.append(f"{draw(st.sampled_from(['', chr(10)]))}<tool_call>\n{body}\n</tool_call>")
        calls.append((name, args))
    return "".join(parts), calls


@settings(max_examples=150, deadline=None)
@given(replies(), st.lists(st.integers(0, 400), max_size=6))
def test_any_split_joins_to_the_whole_reply(reply, cuts):
    text, written = reply
    cuts = [c for c in cuts if c <= len(text)]
    whole_content, whole_calls = parse_tool_calls(text, TOOLS)
    stream, pieces = streamed(text, cuts)
    content, calls = joined(pieces)
    assert content == whole_content
    assert [(n, a) for _, n, a in calls.values()] == [(c.name, c.arguments) for c in whole_calls]
    known = [(n, a) for n, a in written if n != "nope"]
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == known
    if "nope" not in [n for n, _ in written]:
        assert vllm_hermes_reference(text, {t.name for t in TOOLS})[1] == known
