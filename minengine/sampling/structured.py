"""What shape a request's output must take: the structured-output request as the client gave it.

One record for OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`). The grammar that
enforces it is built from this by `sampling.grammar`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """The constraint on a request's text."""

    kind: StructuredKind
    spec: str = ""  # json_schema: the schema as JSON text; regex: the pattern; grammar: Lark (or GBNF) text
    choices: tuple[str, ...] = ()  # kind "choice": the allowed answers
    name: str = ""  # json_schema's `name`, for display

    def describe(self) -> str:
        """A few words for screens and logs: `json_schema "hotel"`, `regex`, `choice of 3`."""
        if self.kind == "json_schema":
            return f'json_schema "{self.name}"' if self.name else "json_schema"
        if self.kind == "choice":
            return f"choice of {len(self.choices)}"
        return self.kind
