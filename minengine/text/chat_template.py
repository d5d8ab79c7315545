"""Chat templates from `tokenizer_config.json`, rendered in jinja2's sandbox.

Templates ship inside model folders, i.e. they are untrusted code: the immutable sandbox
refuses attribute access to Python internals (`__class__`, `__globals__`, ...) and
in-place mutation, so a hostile template fails with a TokenizerError instead of running.
The environment mirrors what Hugging Face provides to templates (trim/lstrip blocks,
loop controls, `raise_exception`, `tojson`, `strftime_now`) so renders match theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minengine.errors import TokenizerError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: str
    content: str


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc.message} (line {exc.lineno})") from None


def render_chat(
    source: str,
    messages: list[Message],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> str:
    """Render `messages` with the model's template, as `apply_chat_template(tokenize=False)` does."""
    template = _compile(source)
    try:
        return template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.exceptions.SecurityError as exc:
        raise TokenizerError(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"the chat template failed to render: {exc}") from None
