"""What tools, a grammar, penalties and bias did to a run, as `--json` records and `--plain` lines.

Per step, the stages before the filters (`StepTrace.adjustments`): the grammar's allowed tokens,
the likely ones it removed and their mass, its state; the tokens whose rank bias or penalties
moved. Per prompt, each part's tokens (the tools' block among them). Per reply, the tool calls
read out of its text (`minengine.text.tool_calls.parse_tool_calls`, the server's own reader).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from minengine.engine.events import PromptEvent, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.sampling.step_trace import Adjustments
from minengine.text.tool_calls import parse_tool_calls
from minengine.text.tools import ToolCall
from reqscope.ui.glyphs import show_piece
from reqscope.ui.run.panels.adjustments import adjustment_lines, stages_before


@dataclass(frozen=True)
class ReplyCalls:
    """A finished reply read for tool calls: the content around them, and the calls."""

    content: str
    calls: tuple[ToolCall, ...]


def reply_calls(request: GenerationRequest | None, text: str) -> ReplyCalls | None:
    """The tool calls in `text`, read as the server reads them; None when the request offered no tools."""
    if request is None or not request.tools or request.tool_choice.mode == "none":
        return None
    content, calls = parse_tool_calls(text, request.tools, request.parallel_tool_calls)
    return ReplyCalls(content, calls)


def adjustments_json(adjustments: Adjustments | None) -> dict | None:
    """A token record's `adjustments`: the grammar's facts, min_tokens, the rank changes, the winners."""
    return None if adjustments is None else asdict(adjustments)


def prompt_record(event: PromptEvent) -> dict:
    """`{"event": "prompt", "tokens": N, "parts": [{"name", "tokens"}]}`: what each part of the template cost."""
    return {
        "event": "prompt",
        "tokens": len(event.pieces),
        "parts": [{"name": p.name, "tokens": p.tokens} for p in event.parts],
    }


def tool_calls_json(calls: ReplyCalls) -> dict:
    """The done record's keys: `content` and `tool_calls` in OpenAI's shape."""
    return {"content": calls.content, "tool_calls": [c.as_dict() for c in calls.calls]}


def step_lines(token: TokenEvent) -> list[str]:
    """One token's step in `--plain`: `step 3  grammar: ...`, then its other lines indented; none without."""
    shown = [line.strip() for line in adjustment_lines(token.trace)] if token.trace is not None else []
    if not shown:
        return []
    head = f"step {token.index + 1:<4} {show_piece(token.piece, 12):<12} "
    return [head + shown[0]] + [" " * len(head) + line for line in shown[1:]]


def run_stages(tokens: list[TokenEvent]) -> tuple[str, ...]:
    """The stages before the filters that ran at any step of a run (the summary's sampler line names them)."""
    traces = [t.trace for t in tokens if t.trace is not None]
    if not traces:
        return ()
    grammar = next((t.adjustments.grammar for t in traces if t.adjustments and t.adjustments.grammar), None)
    masked = max((t.adjustments.min_tokens_masked for t in traces if t.adjustments), default=0)
    return tuple(stages_before(traces[-1].params, Adjustments(grammar=grammar, min_tokens_masked=masked)))


def call_lines(calls: ReplyCalls) -> list[str]:
    """`tool call  search_hotels({"city": "Kyoto", ...})` a call, or a line saying the reply made none."""
    if not calls.calls:
        return ["tool call none read from the reply"]
    return [f"tool call {c.name}({_compact(c.arguments)})  id {c.id}" for c in calls.calls]


def _compact(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments  # cut off (max_tokens): shown as far as it went
