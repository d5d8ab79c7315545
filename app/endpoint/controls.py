"""What the endpoint client asks of the output beyond sampling: tools, a structured shape, penalties, bias.

Taken from the shared request records (`GenerationRequest.tools`, `.tool_choice`, `.structured`,
`SamplingParams`' penalties and logit bias) and sent under OpenAI's field names (`tools`,
`tool_choice`, `response_format`, `presence_penalty`, `frequency_penalty`, `logit_bias`), with
vLLM's extras where OpenAI has no field (`repetition_penalty`; a regex, a choice or a grammar as
`structured_outputs`). As with sampling, only what the user asked for goes in the body.

Where a server is known not to read a field, the request is refused with one line saying so,
rather than sent with a field the server would silently ignore: llama-server has no regex,
choice or `repetition_penalty` (its `repeat_penalty` looks at the last 64 tokens only), and
OpenAI's own API refuses vLLM's extras.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.sampling.params import SamplingParams
from minengine.sampling.structured import StructuredOutput
from minengine.text.tools import Tool, ToolChoice
from reqscope.endpoint.server.records import LLAMA_SERVER

OPENAI_API = "openai"  # api.openai.com: not a ServerKind of its own (detection answers "unknown")
PENALTIES: tuple[str, ...] = ("repetition_penalty", "frequency_penalty", "presence_penalty")
_NEUTRAL = SamplingParams()  # each penalty's value when it is off
_VLLM_STRUCTURED = {"regex": "regex", "choice": "choice", "grammar": "grammar"}  # kind -> structured_outputs key


@dataclass(frozen=True)
class OutputControls:
    """The output controls of one request; each empty or None one is left out of the body."""

    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None  # None: the server's default (OpenAI: "auto" when tools are given)
    parallel_tool_calls: bool | None = None  # None: the server's default
    structured: StructuredOutput | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    @classmethod
    def of(cls, request: GenerationRequest, given: Iterable[str] = ()) -> OutputControls:
        """The controls `request` carries. A penalty is sent when it is on, or when its name is in
        `given` (the flags the user gave: a neutral value given on purpose overrides a server's
        generation_config); `tool_choice` when it is not OpenAI's default, or is in `given`."""
        given = frozenset(given)
        sampling = request.sampling
        penalties = {
            name: getattr(sampling, name)
            for name in PENALTIES
            if name in given or getattr(sampling, name) != getattr(_NEUTRAL, name)
        }
        choice = request.tool_choice
        default_choice = choice == ToolChoice() and "tool_choice" not in given
        return cls(
            tools=request.tools,
            tool_choice=None if default_choice else choice,
            parallel_tool_calls=None if request.parallel_tool_calls else False,
            structured=request.structured,
            logit_bias=tuple(sampling.logit_bias),
            **penalties,
        )

    def check(self, server: str) -> None:
        """Refuse, with one line, what `server` (a ServerKind name, or OPENAI_API) is known not to read."""
        choice = self.tool_choice
        if choice is not None and choice.mode in ("required", "function") and not self.tools:
            raise ReqscopeError(
                f"--tool-choice {_choice_text(choice)} needs the tools to choose from: give --tools FILE"
            )
        kind = self.structured.kind if self.structured is not None else None
        if server == LLAMA_SERVER:
            if kind in ("regex", "choice"):
                raise ReqscopeError(
                    f"llama-server takes no {kind} (vLLM's structured_outputs.{kind}); give it a JSON schema "
                    "(--json-schema FILE) or send the request to vLLM"
                )
            if self.repetition_penalty is not None:
                raise ReqscopeError(
                    "llama-server has no repetition_penalty (its repeat_penalty counts only the last 64 tokens); "
                    "use --frequency-penalty or --presence-penalty with it"
                )
        if server == OPENAI_API:
            extras = [name for name, on in (("repetition_penalty", self.repetition_penalty is not None),
                                            (f"structured_outputs.{kind}", kind in _VLLM_STRUCTURED)) if on]
            if extras:
                raise ReqscopeError(f"OpenAI's API refuses vLLM's {' and '.join(extras)}; leave it out")

    def body_fields(self, server: str = "") -> dict:
        """The body fields these controls add, for `server` (a ServerKind name): OpenAI's names, vLLM's extras."""
        body: dict = {}
        if self.tools:
            body["tools"] = [tool.as_dict() for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = tool_choice_value(self.tool_choice)
        if self.parallel_tool_calls is not None and self.tools:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.structured is not None:
            body.update(structured_fields(self.structured, server))
        for name in PENALTIES:
            if (value := getattr(self, name)) is not None:
                body[name] = value
        if self.logit_bias:
            # OpenAI's form: token ids as JSON object keys (strings); vLLM and llama-server read it too.
            body["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        return body

    def lines(self) -> tuple[str, ...]:
        """What was asked, one line each, for the plain printer and the request panel."""
        out = []
        if self.tools:
            names = ", ".join(tool.name for tool in self.tools)
            choice = f", tool_choice {_choice_text(self.tool_choice)}" if self.tool_choice is not None else ""
            out.append(f"tools {names}{choice}")
        elif self.tool_choice is not None:
            out.append(f"tool_choice {_choice_text(self.tool_choice)}")
        if self.structured is not None:
            out.append(f"output {self.structured.describe()}")
        adjust = [f"{name} {getattr(self, name):g}" for name in PENALTIES if getattr(self, name) is not None]
        if self.logit_bias:
            adjust.append("logit_bias " + ", ".join(f"{token}:{bias:+g}" for token, bias in self.logit_bias))
        if adjust:
            out.append(", ".join(adjust))
        return tuple(out)


def tool_choice_value(choice: ToolChoice) -> str | dict:
    """OpenAI's `tool_choice`: "none", "auto", "required", or the named function's object."""
    if choice.mode == "function":
        return {"type": "function", "function": {"name": choice.function}}
    return choice.mode


def structured_fields(structured: StructuredOutput, server: str = "") -> dict:
    """The body fields that ask for `structured`: OpenAI's `response_format` for JSON, vLLM's
    `structured_outputs` for a regex, a choice or a grammar (llama-server: its GBNF `grammar`)."""
    kind = structured.kind
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {"name": structured.name or "output", "schema": json.loads(structured.spec)}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    if kind == "grammar" and server == LLAMA_SERVER:
        return {"grammar": structured.spec}
    value = list(structured.choices) if kind == "choice" else structured.spec
    return {"structured_outputs": {_VLLM_STRUCTURED[kind]: value}}


def _choice_text(choice: ToolChoice | None) -> str:
    if choice is None:
        return "auto"
    return choice.function or "function" if choice.mode == "function" else choice.mode


def shape_line(structured: StructuredOutput, text: str) -> str:
    """Whether the answer's text took the shape asked for, as far as the client can tell without a
    schema validator: JSON that parses (json_object, json_schema), a full match (regex), one of the
    choices. A server that ignored the request shows here."""
    asked = structured.describe()
    if structured.kind in ("json_object", "json_schema"):
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            return f"{asked} asked; the text is not JSON ({exc.msg} at character {exc.pos})"
        return f"{asked} asked; the text is JSON"
    if structured.kind == "regex":
        try:
            matched = re.fullmatch(structured.spec, text) is not None
        except re.error:
            return f"{asked} asked; Python's re cannot read the pattern to check the text"
        return f"{asked} asked; the text {'matches' if matched else 'does not match'} it"
    if structured.kind == "choice":
        return f"{asked} asked; the text {'is' if text in structured.choices else 'is not'} one of them"
    return f"{asked} asked"
