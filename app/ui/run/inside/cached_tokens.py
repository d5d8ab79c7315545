"""What the cache holds at each position as the attention detail names it: the token and where it came from."""

from __future__ import annotations

from minengine.inspect.positions import OUTPUT, TEMPLATE_KIND, PositionOrigin, position_origin
from reqscope.ui.run.view import RunView

# How a position's origin reads in one short column; "+r": its K/V was reused from the prefix cache.
KIND_LABEL = {OUTPUT: "output", TEMPLATE_KIND: "template", "prompt": "prompt"}
REUSED_MARK = "+r"


def position_piece(view: RunView, position: int) -> str:
    """The text of the token cached at `position`: a prompt piece, else an output token ("?" if unseen)."""
    prompt = view.prompt.pieces if view.prompt is not None else ()
    if position < len(prompt):
        return prompt[position].text
    index = position - len(prompt)
    return view.tokens[index].piece if 0 <= index < len(view.tokens) else "?"


def origin(view: RunView, position: int) -> PositionOrigin:
    """Where the token at `position` came from (a trace without token parts counts every prompt token as prompt)."""
    prompt = view.prompt
    if prompt is None:
        return position_origin(position, (), 0)
    parts = prompt.token_parts or ("user",) * len(prompt.pieces)
    return position_origin(position, parts, view.reused_tokens)


def kind_label(found: PositionOrigin) -> str:
    """The origin in the detail's kind column, e.g. "prompt", "template+r", "output"."""
    return KIND_LABEL[found.kind] + (REUSED_MARK if found.reused else "")
