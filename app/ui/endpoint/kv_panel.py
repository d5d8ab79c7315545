"""The KV cache of a model served elsewhere: not observable from the client, computed by the planner instead.

An OpenAI-compatible endpoint keeps its cache inside its engine; nothing on the wire says how
big it is or how it is laid out. With `--card` naming the served model's shape, the planner's
formula (2 x layers x KV heads x head dim x bytes per element, per token) gives what the cache
logically holds for the tokens counted so far, and what the same model would hold with MHA.
Every figure here is computed, and the panel says so.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.errors import ReqscopeError
from minengine.kv.arithmetic import KIB, MIB
from minengine.plan.cards import Architecture
from reqscope.endpoint.kv import planned_kv
from reqscope.ui.endpoint.frame import EndpointFrame
from reqscope.ui.endpoint.view import EndpointView
from reqscope.ui.glyphs import bar
from reqscope.ui.panel import Panel
from reqscope.wording import error_text


class EndpointKVPanel(Panel[EndpointFrame]):
    """Why per-layer KV is not shown, then the planner's figures for --card, GQA against MHA."""

    TITLE = "KV cache (computed, not observed)"
    WAITING = "sending…"

    def draw(self, frame: EndpointFrame, width: int, height: int) -> RenderableType:
        lines = [Text("per-layer KV: not exposed by the endpoint", style="bold", no_wrap=True, overflow="ellipsis"),
                 Text("(the cache lives inside the server's engine)", style="dim", no_wrap=True, overflow="ellipsis")]
        if frame.arch is None:
            lines.append(Text(
                "pass --card MODEL (a card name, a model folder or a config.json) for the planner's computed KV",
                style="dim",
            ))
            return Group(*lines)
        return Group(*lines, *_planned(frame.arch, frame.view, width))


def _planned(arch: Architecture, view: EndpointView, width: int) -> list[Text]:
    usage = view.result.usage if view.result is not None else None
    prompt = usage.prompt_tokens if usage is not None else None
    output, source = view.output_tokens()
    try:
        plan = planned_kv(arch, prompt, output if output else None)
    except ReqscopeError as exc:  # e.g. MLA or sliding windows: the standard formula does not apply
        return [Text(f"the planner cannot compute this model's KV: {error_text(exc)}", style="yellow")]
    mem = plan.memory
    shape = Text(no_wrap=True, overflow="ellipsis")
    shape.append(f"planner: {arch.name}", style="bold")
    dims = Text(f"{arch.layers} layers × {arch.kv_heads} KV heads ({arch.q_heads} query) × {arch.head_dim}",
                no_wrap=True, overflow="ellipsis")
    dims.append(f"\n{plan.inputs.kv_dtype} · {mem.kv_bytes_per_token / KIB:.1f} KiB/token")
    # The cache holds every prompt token and every output token but the newest, which is never fed back.
    held_output = max(output - 1, 0)
    counted = Text(no_wrap=True, overflow="ellipsis")
    if prompt is None:
        tokens = held_output
        counted.append(f"output so far {output} ({source}): ", style="bold")
        counted.append(f"{tokens * mem.kv_bytes_per_token / MIB:.3f} MiB", style="bold green")
        later = Text("the prompt's share once the server reports usage", style="dim", no_wrap=True,
                     overflow="ellipsis")
    else:
        tokens = prompt + held_output
        counted.append(f"{prompt} prompt + {held_output} output tokens: ", style="bold")
        counted.append(f"{tokens * mem.kv_bytes_per_token / MIB:.3f} MiB", style="bold green")
        later = Text(f"prompt alone {mem.prompt_kv_bytes / MIB:.3f} MiB · "
                     f"per layer {tokens * mem.kv_bytes_per_token / arch.layers / MIB:.4f} MiB", style="dim",
                     no_wrap=True, overflow="ellipsis")
    layouts = _layouts(arch, mem.kv_bytes_per_token, mem.kv_bytes_per_token_mha, mem.kv_bytes_per_token_mqa,
                       tokens, width)
    return [shape, dims, counted, later, *layouts]


def _layouts(arch: Architecture, gqa: int, mha: int, mqa: int, tokens: int, width: int) -> list[Text]:
    """The same token count in each layout, as bars scaled to MHA."""
    lines = [Text("the same tokens in each layout:", style="dim", no_wrap=True)]
    bar_width = max(width - 34, 4)
    rows = [("MHA", mha), (f"GQA {arch.q_heads // arch.kv_heads}:1", gqa), ("MQA", mqa)]
    if arch.kv_heads in (1, arch.q_heads):  # the model is MHA or MQA itself: no separate GQA row
        rows.pop(1)
    for name, per_token in rows:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{name:<9}", style="bold" if per_token == gqa else "dim")
        line.append(bar(per_token / mha if mha else 0.0, bar_width), style="green" if per_token == gqa else "dim")
        line.append(f" {tokens * per_token / MIB:9.3f} MiB {per_token / KIB:5.1f} KiB")
        lines.append(line)
    return lines
