"""Chat templates from `tokenizer_config.json`, rendered in jinja2's sandbox.

Templates ship inside model folders, i.e. they are untrusted code: the immutable sandbox
refuses attribute access to Python internals (`__class__`, `__globals__`, ...) and
in-place mutation, so a hostile template fails with a TokenizerError instead of running.
The sandbox bounds neither time nor size, so each render also runs under a budget: `range`
counts its iterations against a deadline, `*` and `**` refuse results past the size limit,
and the output is collected chunk by chunk against the same deadline and size. A real chat
template renders in well under a millisecond; the budget only ever stops a hostile one.
The environment mirrors what Hugging Face provides to templates (trim/lstrip blocks,
loop controls, `raise_exception`, `tojson`, `strftime_now`) so renders match theirs.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from minengine.errors import TokenizerError
from minengine.text.tools import Tool, ToolCall

ROLES = ("system", "user", "assistant", "tool")
RENDER_SECONDS = 2.0  # a render that runs longer is stopped
RENDER_MIN_CHARS = 1 << 20  # output allowed whatever the messages: 1 Mi characters ...
RENDER_CHARS_PER_INPUT = 16  # ... or 16 per character of the messages, if that is more
_CHECK_EVERY = 1024  # range iterations between two looks at the clock


@dataclass(frozen=True)
class Message:
    """One chat message: an assistant turn may carry the tool calls it made, a `tool` turn the
    id of the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None  # a `tool` message's function name, where the client gave it


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _OverBudget(Exception):
    """A render ran past its time or size budget."""


@dataclass
class _Budget:
    deadline: float
    max_chars: int
    steps: int = 0

    def tick(self) -> None:
        self.steps += 1
        if self.steps % _CHECK_EVERY == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"it ran longer than {RENDER_SECONDS:g} s")

    def check_size(self, chars: int) -> None:
        if chars > self.max_chars:
            raise _OverBudget(f"its output passed {self.max_chars:,} characters")


_active = threading.local()  # the budget of the render running on this thread


def _budget() -> _Budget:
    budget = getattr(_active, "budget", None)
    if budget is None:  # rendered outside render_chat (not done here): a fresh default budget
        budget = _Budget(time.monotonic() + RENDER_SECONDS, RENDER_MIN_CHARS)
    return budget


class _BudgetedRange:
    """`range` for templates: the sandbox's length cap, plus every iteration counted."""

    def __init__(self, rng: range) -> None:
        self.rng = rng

    def __iter__(self):
        budget = _budget()
        for i in self.rng:
            budget.tick()
            yield i

    def __reversed__(self):
        return iter(_BudgetedRange(self.rng[::-1]))

    def __len__(self) -> int:
        return len(self.rng)

    def __contains__(self, value) -> bool:
        return value in self.rng

    def __getitem__(self, index):
        item = self.rng[index]
        return _BudgetedRange(item) if isinstance(item, range) else item


def _range(*args: int) -> _BudgetedRange:
    return _BudgetedRange(safe_range(*args))


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` refusing results too large for the budget."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(count, int):
                    _budget().check_size(len(seq) * count)
        elif operator == "**" and isinstance(right, int | float) and abs(right) > 1024 and abs(left) > 1:
            raise _OverBudget(f"it computed a power too large ({left!r} ** {right!r})")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["range"] = _range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc.message} (line {exc.lineno})") from None


@lru_cache(maxsize=8)
def fixed_generation_prompt(source: str) -> str | None:
    """What `add_generation_prompt` appends to every render of the template `source`, when that
    is a fixed text: "" for a template that never reads the flag, the literal text of a closing
    `{% if add_generation_prompt %}...{% endif %}` (ChatML's and most templates'). None for any
    other use of the flag, whose effect may depend on the messages (or a template that does not
    parse: rendering it reports why).

    Rendering with the flag is then rendering without it, plus this text, read off the syntax
    tree: the template is never run here.
    """
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return None
    uses = [name for name in tree.find_all(nodes.Name) if name.name == "add_generation_prompt"]
    if not uses:
        return ""
    last = tree.body[-1] if tree.body else None
    closing = (
        isinstance(last, nodes.If)
        and isinstance(last.test, nodes.Name)
        and last.test.name == "add_generation_prompt"
        and not last.elif_
        and not last.else_
    )
    if len(uses) != 1 or not closing:
        return None
    text: list[str] = []
    for node in last.body:
        for item in node.nodes if isinstance(node, nodes.Output) else (node,):
            if isinstance(item, nodes.TemplateData):
                text.append(item.data)
            elif isinstance(item, nodes.Const) and isinstance(item.value, str):
                text.append(item.value)
            else:  # anything computed
                return None
    return "".join(text)


@lru_cache(maxsize=8)
def template_supports_tools(source: str) -> bool:
    """Whether the template `source` reads the `tools` variable (its own tool syntax), from its
    syntax tree; False for a template that does not parse."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    return any(name.name == "tools" and name.ctx == "load" for name in tree.find_all(nodes.Name))


def _call_dict(call: ToolCall) -> dict:
    # Arguments go to the template as a dict, as transformers documents them and as vLLM passes
    # them (it parses OpenAI's JSON text): templates write them with `tojson`, which would quote
    # the text a second time. Text that is not a JSON object stays text.
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    if not isinstance(arguments, dict):
        arguments = call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def message_dict(message: Message) -> dict:
    """A message as a chat template reads it (OpenAI's keys, only those the message has)."""
    out: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [_call_dict(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def render_chat(
    source: str,
    messages: list[Message],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    tools: tuple[Tool, ...] = (),
) -> str:
    """Render `messages` with the model's template, as `apply_chat_template(tokenize=False)` does:
    the same variables (`messages`, `tools` as OpenAI's `{"type": "function", ...}` dicts or None,
    `documents`, `add_generation_prompt`, the special tokens).

    Raises TokenizerError, one line, for every way a template can fail: a syntax error, an unsafe
    operation, `raise_exception`, any error while rendering, a render past the time or size
    budget, or one that renders nothing.
    """
    template = _compile(source)
    tool_dicts = [t.as_dict() for t in tools] or None
    input_chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)
    input_chars += sum(len(t.parameters) + len(t.description) for t in tools)
    budget = _Budget(time.monotonic() + RENDER_SECONDS, max(RENDER_MIN_CHARS, RENDER_CHARS_PER_INPUT * input_chars))
    _active.budget = budget
    chunks: list[str] = []
    size = 0
    try:
        for chunk in template.generate(
            messages=[message_dict(m) for m in messages],
            tools=tool_dicts,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        ):
            chunks.append(chunk)
            size += len(chunk)
            budget.check_size(size)
            budget.check_time()
    except jinja2.exceptions.SecurityError as exc:
        raise TokenizerError(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"the chat template failed to render: {exc}") from None
    except _OverBudget as exc:
        raise TokenizerError(f"the chat template was stopped: {exc}") from None
    except RecursionError:
        raise TokenizerError("the chat template was stopped: it recursed too deeply") from None
    except Exception as exc:  # noqa: BLE001 - untrusted code: any failure is the template's, told in one line
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise TokenizerError(f"the chat template failed to render: {type(exc).__name__}: {detail}") from None
    finally:
        _active.budget = None
    rendered = "".join(chunks)
    if not rendered:
        raise TokenizerError("the chat template rendered nothing for these messages")
    return rendered
