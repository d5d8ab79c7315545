"""Tools in the chat template: native rendering against transformers, reqscope's generic block,
refusal, the tool parts of the prompt, and `--chat-template FILE`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minengine.engine.events import DoneEvent, PromptEvent, StageEvent
from minengine.engine.request import GenerationRequest
from minengine.errors import RequestError, TokenizerError
from minengine.sampling.params import SamplingParams
from minengine.text.chat_template import Message, template_supports_tools
from minengine.text.prompt_parts import count_parts, token_parts
from minengine.text.tokenizer import ModelTokenizer
from minengine.text.tool_prompt import (
    GENERIC_TOOLS_PART,
    TOOLS_PART,
    generic_tool_block,
    tool_rendering,
    tool_spans,
)
from minengine.text.tools import Tool, ToolCall

QWEN_TEMPLATE_FILE = Path(__file__).parents[1] / "data" / "qwen2.5-chat-template.jinja"

WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    '{"type": "object", "properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}',
)
TIME = Tool("get_time", "Local time, by time zone", '{"type": "object", "properties": {"tz": {"type": "string"}}}')
TOOLS = (WEATHER, TIME)

# One conversation, as reqscope's records and as the dicts transformers documents (arguments as a dict).
HISTORY = (
    Message("system", "You are terse."),
    Message("user", "Weather and time in Paris?"),
    Message(
        "assistant",
        "",
        (
            ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_2", "get_time", '{"tz": "Europe/Paris"}'),
        ),
    ),
    Message("tool", "18°C, sunny", tool_call_id="call_1", name="get_weather"),
    Message("tool", "14:02", tool_call_id="call_2"),
    Message("user", "Thanks. And in Kyoto?"),
)
HISTORY_DICTS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}},
        ],
    },
    {"role": "tool", "content": "18°C, sunny", "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "tool", "content": "14:02", "tool_call_id": "call_2"},
    {"role": "user", "content": "Thanks. And in Kyoto?"},
]
TOOL_DICTS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time, by time zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def smol(default_model_dir) -> ModelTokenizer:
    return ModelTokenizer(default_model_dir)


@pytest.fixture(scope="module")
def qwen(default_model_dir) -> ModelTokenizer:
    """The default model's tokenizer with Qwen2.5-Instruct's chat template (it has tool syntax)."""
    return ModelTokenizer(default_model_dir, chat_template_file=QWEN_TEMPLATE_FILE)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


def parts_of(tok: ModelTokenizer, messages, tools, generic=True) -> tuple[str, tuple[str, ...], list]:
    chat = tok.chat_input(messages, tools, generic)
    rendered = tok.render(list(messages), tools=tools, generic_tools=generic)
    start = tok.generation_prompt_start(list(messages), rendered, tools=tools, generic_tools=generic)
    pieces = tok.encode_pieces(rendered)
    spans = tool_spans(rendered, chat, start)
    return rendered, token_parts(rendered, start, chat.messages, pieces, chat.parts, spans), pieces


def text_of(part: str, names, pieces) -> str:
    return "".join(p.text for p, n in zip(pieces, names, strict=True) if n == part)


# -- native: the template's own tool syntax, as transformers renders it --------------------------


@pytest.mark.parametrize("history", [HISTORY, HISTORY[1:]], ids=["system", "default-system"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_tool_template_renders_as_transformers_does(qwen, hf_tokenizer, history, generation_prompt):
    dicts = HISTORY_DICTS[len(HISTORY) - len(history) :]
    ours = qwen.render(list(history), add_generation_prompt=generation_prompt, tools=TOOLS)
    theirs = hf_tokenizer.apply_chat_template(
        dicts,
        tools=TOOL_DICTS,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        chat_template=qwen.chat_template,
    )
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
    assert "<tool_response>\n14:02\n</tool_response>" in ours


def test_without_tools_a_tool_template_renders_as_transformers_does(qwen, hf_tokenizer):
    messages = [Message("user", "hi")]
    theirs = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
        chat_template=qwen.chat_template,
    )
    assert qwen.render(messages) == theirs
    assert "# Tools" not in theirs


def test_tool_support_is_read_from_the_template(smol, qwen):
    assert template_supports_tools(qwen.chat_template)
    assert not template_supports_tools(smol.chat_template)
    assert not template_supports_tools("{{ messages[0].tools }}")  # an attribute, not the variable
    assert tool_rendering(qwen.chat_template, TOOLS, generic=False) == "native"
    assert tool_rendering(smol.chat_template, TOOLS, generic=True) == "generic"
    assert tool_rendering(smol.chat_template, TOOLS, generic=False) == "none"
    assert tool_rendering(qwen.chat_template, (), generic=True) == "none"


def test_native_tool_definitions_are_their_own_part(qwen):
    rendered, names, pieces = parts_of(qwen, HISTORY, TOOLS)
    tools_text = text_of(TOOLS_PART, names, pieces)
    # Both definitions, as the template's `tojson` wrote them; its instructions stay template.
    assert tools_text == "".join(json.dumps(d, ensure_ascii=False) for d in TOOL_DICTS)
    assert "You may call" not in tools_text and "You may call" in text_of("template", names, pieces)
    assert text_of("system", names, pieces) == "You are terse."
    assert sum(p.tokens for p in count_parts(names)) == len(pieces)


# -- generic: reqscope's own block for a template without tool syntax ----------------------------


def test_the_generic_block_goes_into_the_system_message(smol):
    rendered = smol.render([Message("system", "You are terse."), Message("user", "Kyoto?")], tools=TOOLS)
    block = generic_tool_block(TOOLS)
    assert rendered == (
        f"<|im_start|>system\nYou are terse.\n\n{block}<|im_end|>\n<|im_start|>user\nKyoto?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert block.startswith("# Tools (written by reqscope")
    for d in TOOL_DICTS:
        assert json.dumps(d, ensure_ascii=False) in block
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in block


def test_without_a_system_message_the_generic_block_leads(smol):
    rendered = smol.render([Message("user", "Kyoto?")], tools=(WEATHER,))
    block = generic_tool_block((WEATHER,))
    assert rendered.startswith(f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nKyoto?")
    assert "SmolLM" not in rendered  # the block is the system message, in place of the template's default


def test_a_tool_history_is_written_as_text_a_plain_template_carries(smol):
    rendered = smol.render(list(HISTORY[1:]), tools=TOOLS)
    block = generic_tool_block(TOOLS)
    assert rendered == (
        f"<|im_start|>system\n{block}<|im_end|>\n"
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
        "<tool_response>\n14:02\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks. And in Kyoto?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_generic_block_is_its_own_counted_part(smol):
    rendered, names, pieces = parts_of(smol, HISTORY, TOOLS)
    block = generic_tool_block(TOOLS)
    counted = {p.name: p.tokens for p in count_parts(names)}
    assert text_of(GENERIC_TOOLS_PART, names, pieces).strip() == block.strip()
    assert counted[GENERIC_TOOLS_PART] == len(smol.encode(block))
    assert text_of("system", names, pieces).startswith("You are terse.")
    assert "<tool_response>" in text_of("tool", names, pieces)
    assert sum(counted.values()) == len(pieces)


def test_tools_are_refused_when_the_generic_block_is_off(smol):
    with pytest.raises(RequestError) as info:
        smol.render([Message("user", "Kyoto?")], tools=TOOLS, generic_tools=False)
    assert "has no tool syntax" in info.value.message
    assert "\n" not in info.value.message
    assert smol.render([Message("user", "Kyoto?")], generic_tools=False)  # no tools: nothing to refuse


# -- through the engine: the prompt event and the stage ----------------------------------------


def test_a_request_with_tools_shows_the_block_in_its_prompt_parts(chatty_engine):
    req = GenerationRequest.from_prompt(
        "Weather in Kyoto?", tools=TOOLS, sampling=SamplingParams(temperature=0.0), max_tokens=1
    )
    events = list(chatty_engine.start(req))
    prompt = next(e for e in events if isinstance(e, PromptEvent))
    parts = {p.name: p.tokens for p in prompt.parts}
    assert parts[GENERIC_TOOLS_PART] == len(chatty_engine.tokenizer.encode(generic_tool_block(TOOLS)))
    assert parts["user"] == len(chatty_engine.tokenizer.encode("Weather in Kyoto?"))
    assert prompt.token_parts.count(GENERIC_TOOLS_PART) == parts[GENERIC_TOOLS_PART]
    templated = next(e for e in events if isinstance(e, StageEvent) and e.name == "template")
    assert "tools generic" in templated.detail
    assert events[-1].result.error is None


def test_a_request_with_tools_is_refused_when_the_generic_block_is_off(chatty_engine):
    req = GenerationRequest.from_prompt("Weather in Kyoto?", tools=TOOLS, generic_tools=False, max_tokens=1)
    done = list(chatty_engine.start(req))[-1]
    assert isinstance(done, DoneEvent)
    assert done.result.finish_reason == "error"
    assert "has no tool syntax" in str(done.result.error)


# -- --chat-template FILE ----------------------------------------------------------------------


def test_a_template_file_replaces_the_folders(default_model_dir, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}", encoding="utf-8")
    tok = ModelTokenizer(default_model_dir, chat_template_file=path)
    assert tok.render([Message("user", "hi")]) == "[user] hi\n"
    assert tok.template_origin == path
    with pytest.raises(TokenizerError, match="cannot read the chat template"):
        tok.use_chat_template_file(tmp_path / "missing.jinja")
