"""What each cached position is, for the attention detail: prompt, template or output, and reused or not."""

from __future__ import annotations

from dataclasses import dataclass

from minengine.text.prompt_parts import GENERATION_PROMPT, TEMPLATE

PROMPT, TEMPLATE_KIND, OUTPUT = "prompt", "template", "output"


@dataclass(frozen=True)
class PositionOrigin:
    """Where one position's token came from."""

    kind: str  # "prompt" (a message's text), "template" (what the chat template added) or "output"
    part: str  # the prompt part ("system", "user", ..., "template", "generation prompt") or "output"
    reused: bool  # its K/V came from the prefix cache: prefill did not compute it


def position_origin(position: int, token_parts: tuple[str, ...], reused_tokens: int) -> PositionOrigin:
    """Where `position` came from, given the prompt's part per token (`PromptEvent.token_parts`) and
    the prefix cache's reused prompt tokens; positions past the prompt are output."""
    if position >= len(token_parts):
        return PositionOrigin(OUTPUT, OUTPUT, False)
    part = token_parts[position]
    kind = TEMPLATE_KIND if part in (TEMPLATE, GENERATION_PROMPT) else PROMPT
    return PositionOrigin(kind, part, position < reused_tokens)
