"""Attribute each prompt token to the part of the chat template it came from.

Each message's content is located in the rendered prompt; a token belongs to the message whose
content span holds its first character. Tokens from where the generation prompt starts belong
to the generation prompt; tokens inside a tool span (`tool_prompt.tool_spans`: reqscope's generic
tool block, or the tool definitions a native template wrote) belong to that span's part, "tools
(reqscope)" or "tools"; everything else (role markers, separators, text the
template adds itself) counts as template. The parts therefore always sum to the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.text.chat_template import Message
from minengine.text.tokenizer import TokenPiece
from minengine.text.tool_prompt import ToolSpan

TEMPLATE = "template"
GENERATION_PROMPT = "generation prompt"


@dataclass(frozen=True)
class PromptPart:
    """How many prompt tokens one part of the template contributes."""

    name: str  # "template", "system", "user", "assistant", "tool", "tools", "tools (reqscope)", "generation prompt"
    tokens: int


def count_parts(names: tuple[str, ...]) -> tuple[PromptPart, ...]:
    """Token counts per part name (`token_parts`), in order of first appearance; they sum to len(names)."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return tuple(PromptPart(name, n) for name, n in counts.items())


def token_parts(
    rendered: str,
    generation_prompt_start: int,
    messages: tuple[Message, ...],
    pieces: list[TokenPiece],
    parts: tuple[str, ...] | None = None,
    tool_spans: tuple[ToolSpan, ...] = (),
) -> tuple[str, ...]:
    """The part each token belongs to, in token order.

    `generation_prompt_start` is where the generation prompt begins in `rendered` (its length
    when there is none; see `ModelTokenizer.generation_prompt_start`). `messages` are those the
    template was given (`ChatInput.messages`), `parts` the part each counts as (its role when
    not given), `tool_spans` where the tools lie; a tool span wins over the message holding it."""
    names_of = parts if parts is not None else tuple(m.role for m in messages)
    spans: list[tuple[int, int, str]] = [(s.start, s.end, s.part) for s in tool_spans]
    cursor = 0
    for msg, part in zip(messages, names_of, strict=True):
        if not msg.content:
            continue
        at = rendered.find(msg.content, cursor)
        if at < 0:
            continue  # the template rewrote the content; its tokens count as template
        spans.append((at, at + len(msg.content), part))
        cursor = at + len(msg.content)
    names: list[str] = []
    for piece in pieces:
        name = TEMPLATE
        if piece.start >= generation_prompt_start:
            name = GENERATION_PROMPT
        else:
            for a, b, role in spans:
                if a <= piece.start < b:
                    name = role
                    break
        names.append(name)
    return tuple(names)
