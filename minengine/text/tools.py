"""Tools a request offers the model, the calls it makes, and how the request lets it choose.

These are the request's own records (OpenAI's `tools`, `tool_choice` and `tool_calls` once the
gateway has checked them). A tool's `parameters` is kept as JSON text: the records are frozen
and hashable, and the text is what a chat template and a grammar both read.

The model writes a call in the Hermes form that Qwen2.5's template teaches and vLLM's `hermes`
parser reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
EMPTY_PARAMETERS = '{"type": "object", "properties": {}}'

ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str = ""
    parameters: str = EMPTY_PARAMETERS  # a JSON schema, as JSON text

    def as_dict(self) -> dict:
        """OpenAI's `{"type": "function", "function": {...}}`, as chat templates read a tool."""
        function: dict = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (or an earlier assistant turn made): `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict:
        """OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    """How the request lets the model choose: not at all, freely, at least one call, or one named function."""

    mode: ToolChoiceMode = "auto"
    function: str | None = None  # the named function, when mode is "function"

    @property
    def forced(self) -> bool:
        """Whether a grammar must make the model call a tool (`required` or a named function)."""
        return self.mode in ("required", "function")
