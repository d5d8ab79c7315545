"""How a request's tools reach the prompt: through the template's own syntax, reqscope's generic
block, or not at all.

A template "supports tools" when it reads the `tools` variable (`template_supports_tools`, from
its syntax tree). Such a template gets the tools and the tool turns of the history as
transformers passes them (`render_chat`). A template without tool syntax (the default SmolLM2's)
gets, as llama.cpp's generic handler gives it, a system block that reqscope writes and labels as
its own: each tool as JSON, and the reply format `<tool_call>{"name", "arguments"}</tool_call>`
that `tool_calls.ToolCallStream` reads back. The history's tool turns are then written as text
the plain template can carry, as Hermes/Qwen write them: an assistant call as its `<tool_call>`
text, a tool result as a user turn wrapped in `<tool_response>`.

`tool_spans` locates what the tools cost in the rendered prompt, for the prompt parts: the whole
generic block ("tools (reqscope)"), or, for a native template, the JSON of each tool definition
where the template wrote it as `tojson` does (compact or indented, the tool or its `function`);
best effort: a template that rewrites the definitions (into Python signatures, say) leaves them
counted as template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from minengine.errors import RequestError, Setting
from minengine.text.chat_template import Message, template_supports_tools
from minengine.text.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, ToolCall

ToolRendering = Literal["native", "generic", "none"]

GENERIC_TOOLS_PART = "tools (reqscope)"
TOOLS_PART = "tools"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_GENERIC_HEADER = "# Tools (written by reqscope: this model's chat template has no tool syntax)"


@dataclass(frozen=True)
class ChatInput:
    """What the chat template is given for one request."""

    messages: tuple[Message, ...]  # as the template reads them (generic: tool turns as text)
    parts: tuple[str, ...]  # the prompt part each message's content counts as
    tools: tuple[Tool, ...]  # the template's `tools` (native rendering only)
    rendering: ToolRendering
    tool_block: str | None = None  # reqscope's generic block, where written


@dataclass(frozen=True)
class ToolSpan:
    """Where tool text lies in a rendered prompt, in characters, and the part it counts as."""

    start: int
    end: int
    part: str


def tool_rendering(template_source: str | None, tools: tuple[Tool, ...], generic: bool) -> ToolRendering:
    """How `tools` reach the prompt under this template: "native" (its own syntax), "generic"
    (reqscope's block) or "none" (no tools, or a template without tool syntax with the generic
    block off: reqscope refuses such a request; vLLM renders it without the tools)."""
    if not tools or template_source is None:
        return "none"
    if template_supports_tools(template_source):
        return "native"
    return "generic" if generic else "none"


def generic_tool_block(tools: tuple[Tool, ...]) -> str:
    """reqscope's system block for a template without tool syntax: the tools and the reply format."""
    listed = "\n".join(json.dumps(t.as_dict(), ensure_ascii=False) for t in tools)
    return (
        f"{_GENERIC_HEADER}\n\n"
        "You may call one or more functions to assist with the user query. "
        "The functions are given as JSON within <tools></tools> tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def call_text(call: ToolCall) -> str:
    """One call written as the model writes it in the Hermes form."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _plain_history(messages: tuple[Message, ...]) -> tuple[tuple[Message, ...], tuple[str, ...]]:
    """Tool turns written as text a template without tool syntax carries; the part of each."""
    out: list[Message] = []
    parts: list[str] = []
    for m in messages:
        if m.role == "tool":
            wrapped = f"{TOOL_RESPONSE_OPEN}\n{m.content}\n{TOOL_RESPONSE_CLOSE}"
            if out and parts[-1] == "tool":  # consecutive results share one user turn, as Qwen's template does
                out[-1] = Message("user", out[-1].content + "\n" + wrapped)
            else:
                out.append(Message("user", wrapped))
                parts.append("tool")
        elif m.tool_calls:
            calls = "\n".join(call_text(c) for c in m.tool_calls)
            out.append(Message(m.role, f"{m.content}\n{calls}" if m.content else calls))
            parts.append(m.role)
        else:
            out.append(m)
            parts.append(m.role)
    return tuple(out), tuple(parts)


def has_tool_turns(messages: tuple[Message, ...]) -> bool:
    """Whether the history holds tool calls or tool results."""
    return any(m.role == "tool" or m.tool_calls for m in messages)


def chat_input(
    template_source: str | None, messages: tuple[Message, ...], tools: tuple[Tool, ...], generic: bool
) -> ChatInput:
    """What the template gets for these messages and tools; raises RequestError, one line, for
    tools a template without tool syntax cannot take when the generic block is off."""
    messages = tuple(messages)
    rendering = tool_rendering(template_source, tools, generic)
    native = template_source is not None and template_supports_tools(template_source)
    if tools and rendering == "none":
        raise RequestError(
            "the model's chat template has no tool syntax and reqscope's own tool block is off (",
            Setting.GENERIC_TOOLS_OFF,
            "); leave out the tools, give a template with tool syntax (",
            Setting.CHAT_TEMPLATE_FILE,
            "), or turn the block back on",
        )
    if native or not (generic and (tools or has_tool_turns(messages))):
        return ChatInput(messages, tuple(m.role for m in messages), tools if native else (), rendering)
    plain, parts = _plain_history(messages)
    if not tools:  # a tool history without tools: written as text, no block
        return ChatInput(plain, parts, (), rendering)
    block = generic_tool_block(tools)
    if plain and plain[0].role == "system":
        first = plain[0]
        merged = Message("system", f"{first.content}\n\n{block}" if first.content else block)
        return ChatInput((merged, *plain[1:]), parts, (), rendering, block)
    return ChatInput((Message("system", block), *plain), ("system", *parts), (), rendering, block)


def _tool_json_forms(tool: Tool) -> list[str]:
    """The texts a template's `tojson` may have written for one tool, longest first."""
    whole = tool.as_dict()
    forms = []
    for value in (whole, whole["function"]):
        for indent in (4, 2, None):
            forms.append(json.dumps(value, ensure_ascii=False, indent=indent))
    return forms


def tool_spans(rendered: str, chat: ChatInput, end: int | None = None) -> tuple[ToolSpan, ...]:
    """Where the tools lie in `rendered` (up to `end`): the generic block, or each tool's JSON as
    a native template wrote it (best effort; what is not found counts as template)."""
    limit = len(rendered) if end is None else end
    if chat.tool_block is not None:
        at = rendered.find(chat.tool_block, 0, limit)
        return (ToolSpan(at, at + len(chat.tool_block), GENERIC_TOOLS_PART),) if at >= 0 else ()
    spans: list[ToolSpan] = []
    cursor = 0
    for tool in chat.tools:
        for form in _tool_json_forms(tool):
            at = rendered.find(form, cursor, limit)
            if at >= 0:
                spans.append(ToolSpan(at, at + len(form), TOOLS_PART))
                cursor = at + len(form)
                break
    return tuple(spans)
