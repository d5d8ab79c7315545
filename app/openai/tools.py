"""OpenAI's tool fields read into the request's records: `tools` (or the older `functions`),
`tool_choice` (or `function_call`), `parallel_tool_calls`, and the `tool_calls` an assistant
message carries.

A tool's `parameters` must be a JSON schema for an object that the grammar library can
compile: `tool_choice` `required` or a named function makes the engine enforce it, and a
schema that cannot be enforced is refused here rather than inside the engine.
"""

from __future__ import annotations

import json
import re

from minengine.text.tools import EMPTY_PARAMETERS, Tool, ToolCall, ToolChoice
from reqscope.openai.errors import invalid, shown
from reqscope.openai.grammar_check import grammar_problem

# OpenAI's rule for a function's name.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit on tools in one request
_CHOICE_MODES = ("none", "auto", "required")


def parse_tools(body: dict) -> tuple[Tool, ...]:
    """`tools`, or the older `functions`; () when neither is given."""
    tools, functions = body.get("tools"), body.get("functions")
    if tools is not None and functions is not None:
        raise invalid("functions", "functions is the older form of tools; send one of them, not both")
    if functions is not None:
        items = _list("functions", functions)
        return _unique(tuple(_function(item, f"functions[{i}]") for i, item in enumerate(items)), "functions")
    if tools is None:
        return ()
    items = _list("tools", tools)
    parsed = []
    for i, item in enumerate(items):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f'{where} must be an object {{"type": "function", "function": {{...}}}}')
        if item.get("type", "function") != "function":
            raise invalid(f"{where}.type", f'{where}.type {shown(item.get("type"))} is not supported; use "function"')
        parsed.append(_function(item.get("function"), f"{where}.function"))
    return _unique(tuple(parsed), "tools")


def parse_tool_choice(body: dict, tools: tuple[Tool, ...]) -> ToolChoice:
    """`tool_choice` (or the older `function_call`): "auto" when tools are given and it is left out."""
    raw, param = body.get("tool_choice"), "tool_choice"
    if body.get("function_call") is not None:
        if raw is not None:
            raise invalid("function_call", "function_call is the older form of tool_choice; send one of them")
        raw, param = body["function_call"], "function_call"
        if isinstance(raw, dict) and "name" in raw and "function" not in raw:  # {"name": X}
            raw = {"type": "function", "function": {"name": raw["name"]}}
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in _CHOICE_MODES:
        if raw != "none" and not tools:
            raise invalid(param, f"{param} {raw!r} needs tools; give tools, or leave {param} out")
        return ToolChoice(raw)
    if not isinstance(raw, dict):
        raise invalid(
            param, f'{param} must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}'
        )
    function = raw.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if raw.get("type", "function") != "function" or not isinstance(name, str):
        raise invalid(param, f'{param} names a function as {{"type": "function", "function": {{"name": ...}}}}')
    known = [t.name for t in tools]
    if name not in known:
        offered = ", ".join(known) if known else "none"
        raise invalid(param, f"{param} names the function {shown(name)}, which is not among the tools ({offered})")
    return ToolChoice("function", name)


def parse_tool_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (arguments as JSON text, or an object)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise invalid(where, f"{where} must be a list of tool calls")
    calls = []
    for j, item in enumerate(raw):
        at = f"{where}[{j}]"
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            raise invalid(at, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        call_id, name = item.get("id", ""), function.get("name")
        if not isinstance(call_id, str):
            raise invalid(f"{at}.id", f"{at}.id must be a string")
        if not isinstance(name, str) or not name:
            raise invalid(f"{at}.function.name", f"{at}.function.name is required and must be a string")
        calls.append(ToolCall(call_id, name, _arguments(function.get("arguments"), f"{at}.function.arguments")))
    return tuple(calls)


def _arguments(raw: object, where: str) -> str:
    """A call's arguments as JSON text of an object."""
    if raw is None:
        return "{}"
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise invalid(where, f"{where} must be a JSON object as text (got {shown(raw)})") from None
    if not isinstance(value, dict):
        raise invalid(where, f"{where} must be a JSON object as text (got {shown(raw)})")
    return raw if isinstance(raw, str) else json.dumps(value, ensure_ascii=False)


def _list(param: str, raw: object) -> list:
    if not isinstance(raw, list):
        raise invalid(param, f"{param} must be a list of functions")
    if len(raw) > MAX_TOOLS:
        raise invalid(param, f"{param} holds at most {MAX_TOOLS} functions (got {len(raw)})")
    return raw


def _function(raw: object, where: str) -> Tool:
    """One function object `{name, description?, parameters?, strict?}`."""
    if not isinstance(raw, dict):
        raise invalid(where, f"{where} must be an object with a name (and description, parameters)")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(
            f"{where}.name",
            f"{where}.name must be 1 to 64 letters, digits, _ or - (got {shown(name)}); give every function a name",
        )
    description = raw.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise invalid(f"{where}.description", f"{where}.description must be a string")
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict", f"{where}.strict must be true or false")
    return Tool(name, description, _parameters(raw.get("parameters"), f"{where}.parameters"))


def _parameters(raw: object, where: str) -> str:
    """A function's parameters: a JSON schema for an object, one the grammar library compiles."""
    if raw is None:
        return EMPTY_PARAMETERS
    if not isinstance(raw, dict):
        raise invalid(where, f"{where} must be a JSON schema object (got {shown(raw)})")
    kind = raw.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise invalid(where, f'{where} must describe an object ("type": "object"), got type {shown(kind)}')
    text = json.dumps(raw, ensure_ascii=False)
    problem = grammar_problem("json_schema", text)
    if problem is not None:
        raise invalid(where, f"{where} is not a JSON schema the grammar library can compile: {problem}")
    return text


def _unique(tools: tuple[Tool, ...], param: str) -> tuple[Tool, ...]:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            at = f"{param}[{i}].function.name" if param == "tools" else f"{param}[{i}].name"
            raise invalid(at, f"{at} {tool.name!r} is given twice; every function needs its own name")
        seen.add(tool.name)
    return tools
