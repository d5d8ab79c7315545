"""One decode step explained: the sampler chain, the top candidates, where each stage cut, the choice."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from minengine.engine.events import TokenEvent
from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import Adjustments, Candidate, StepTrace
from reqscope.ui.glyphs import show_piece
from reqscope.ui.panel import Panel
from reqscope.ui.run.frame import Frame
from reqscope.ui.run.panels.adjustments import adjustment_lines, stages_before

_RECENT_MIN_ROWS = 4  # spare rows below the candidates before the recent steps are worth showing
# Column headings, aligned with _candidate_line's fields. `p(T)` is the model's distribution at the
# temperature shown; `Σtop-p` is the running sum top-p compared with its threshold, on the
# distribution top-p saw (`basis_note` says when that is another one).
_HEADER = f"{'':2}{'#':>2} {'token':<12} {'id':>6} {'logit':>6} {'p(T)':>6} {'Σtop-p':>6}  status"


def chain_text(params: SamplingParams, adjustments: Adjustments | None = None) -> str:
    """The sampler chain in the order it runs, each stage with its value or `off`.

    The stages before the filters (the grammar, min_tokens, bias, the penalties: `stages_before`)
    come first, named only when on.
    """
    before = stages_before(params, adjustments)
    if params.greedy:
        return " -> ".join(["logits", *before, "argmax (temperature 0: greedy)"])
    values = {
        "temperature": f"temperature {params.temperature:g}" if params.temperature != 1 else "temperature off",
        "top_k": f"top_k {params.top_k}" if params.top_k else "top_k off",
        "top_p": f"top_p {params.top_p:g}" if params.top_p < 1 else "top_p off",
        "min_p": f"min_p {params.min_p:g}" if params.min_p else "min_p off",
    }
    return " -> ".join(["logits", *before, *(values[s] for s in params.order), "dist"])


def cut_positions(trace: StepTrace) -> dict[int, str]:
    """Row index -> label of the cut line drawn just above that candidate row."""
    params, cands = trace.params, trace.candidates
    cuts: dict[int, str] = {}
    if params.greedy:
        return {1: "greedy: only the argmax"} if len(cands) > 1 else {}
    if 0 < params.top_k < len(cands):
        cuts[params.top_k] = f"top-k {params.top_k}"
    first_top_p = next((i for i, c in enumerate(cands) if c.dropped_by == "top_p"), None)
    if first_top_p is not None:
        mass = f", kept {trace.top_p_cut:.3f}" if trace.top_p_cut is not None else ""
        cuts[first_top_p] = _join(cuts.get(first_top_p), f"top-p {params.top_p:g}{mass}")
    first_min_p = next((i for i, c in enumerate(cands) if c.dropped_by == "min_p"), None)
    if first_min_p is not None:
        cuts[first_min_p] = _join(cuts.get(first_min_p), f"min-p {params.min_p:g}")
    return cuts


def basis_note(params: SamplingParams, vocab_size: int) -> str | None:
    """Why `p(T)` and `Σtop-p` on one row differ: the stages that ran before top-p changed what it saw.

    None when top-p saw the distribution `p(T)` shows (the sum of the rows' `p(T)` is then `Σtop-p`).
    """
    if params.greedy:
        return None
    before = params.order[: params.order.index("top_p")]
    after = params.order[params.order.index("top_p") + 1 :]
    changes = []
    if "top_k" in before and params.top_k and (not vocab_size or params.top_k < vocab_size):
        changes.append(f"top-k {params.top_k}'s survivors")
    if "min_p" in before and params.min_p:
        changes.append(f"min-p {params.min_p:g}'s survivors")
    unscaled = "temperature" in after and params.temperature != 1
    if not changes and not unscaled:
        return None
    basis = " and ".join(changes) + ", renormalised" if changes else "the whole vocabulary"
    if unscaled:
        basis += ", at T=1 (temperature runs after top-p)"
    return f"p(T): all {vocab_size or '?'} tokens · Σtop-p: {basis}"


def _join(a: str | None, b: str) -> str:
    return b if a is None else f"{a} · {b}"


class LogitsPanel(Panel):
    """The chain line, a summary line, then candidate rows with cut lines between them."""

    TITLE = "Logits & sampling"

    def draw(self, frame: Frame, width: int, height: int) -> RenderableType:
        subject = frame.subject
        adjustments = subject.trace.adjustments if subject is not None else None
        chain = Text(chain_text(frame.params, adjustments), style="bold", no_wrap=True, overflow="ellipsis")
        if subject is None:
            return Group(chain, Text("no step yet: logits appear after prefill", style="dim"))
        trace = subject.trace
        lines = [chain, _summary(subject.label, trace, subject.path)]
        for line in adjustment_lines(trace):
            lines.append(Text(line, style="magenta", no_wrap=True, overflow="ellipsis"))
        note = basis_note(trace.params, trace.vocab_size)
        if note is not None:
            lines.append(Text(note, style="dim", no_wrap=True, overflow="ellipsis"))
        lines.append(Text(_HEADER[:width], style="dim underline", no_wrap=True))
        rows = _candidate_rows(trace, frame.cursor if subject.pickable else None, width)
        room = max(height - len(lines), 1)
        lines += _window(rows, frame.cursor, room)
        spare = height - len(lines) - 1
        if spare >= _RECENT_MIN_ROWS:
            lines += [Text("")] + _recent_steps(frame.view.tokens, spare)
        return Group(*lines)


def _summary(label: str, trace: StepTrace, path: str = "") -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(label, style="italic")
    text.append(f"  kept {trace.kept}/{trace.vocab_size or '?'}  H {trace.entropy:.2f} nats  ")
    text.append(f"chosen {show_piece(trace.chosen_piece, 12)}", style="bold")
    text.append(f" logprob {trace.chosen_logprob:.2f}")
    if trace.forced:
        text.append(" (forced)", style="bold")
    if path:  # the way the step's arithmetic ran: the first thing cut on a narrow screen
        text.append(f" · {path}", style="cyan")
    return text


def _candidate_rows(trace: StepTrace, cursor: int | None, width: int) -> list[tuple[int | None, Text]]:
    """(candidate index or None for a cut line, the line)."""
    cuts = cut_positions(trace)
    rows: list[tuple[int | None, Text]] = []
    for i, cand in enumerate(trace.candidates):
        if i in cuts:
            label = f" {cuts[i]} "
            rows.append((None, Text(("──" + label).ljust(width, "─"), style="yellow", no_wrap=True)))
        rows.append((i, _candidate_line(i, cand, cand.token_id == trace.chosen_id, i == cursor, width)))
    return rows


def _candidate_line(i: int, cand: Candidate, chosen: bool, selected: bool, width: int) -> Text:
    mark = "▶" if chosen else " "
    pointer = "›" if selected else " "
    status = f"kept {cand.final_prob:5.1%}" if cand.dropped_by is None else f"× {cand.dropped_by}"
    line = (
        f"{pointer}{mark}{i + 1:2d} {show_piece(cand.piece, 12):<12} {cand.token_id:>6} "
        f"{cand.logit:6.2f} {cand.prob:6.1%} {cand.cumulative:6.1%}  {status}"
    )
    style = "dim" if cand.dropped_by is not None else ""
    if chosen:
        style += " bold"
    if selected:
        style += " reverse"
    return Text(line, style=style.strip(), no_wrap=True, overflow="ellipsis")


def _recent_steps(tokens: list[TokenEvent], rows: int) -> list[Text]:
    """The last committed tokens: probability, survivors, entropy, forced or sampled."""
    heading = f"{'step':>5} {'token':<12} {'p model':>7} {'kept':>6} {'H nats':>7}"
    lines = [Text(heading, style="dim underline", no_wrap=True)]
    for token in tokens[-(rows - 1) :]:
        trace = token.trace
        if trace is None:
            continue
        how = " forced" if token.forced else ""
        lines.append(Text(
            f"{token.index + 1:>5} {show_piece(token.piece, 12):<12} {math.exp(trace.chosen_logprob):7.1%} "
            f"{trace.kept:>6} {trace.entropy:7.2f}{how}",
            no_wrap=True, overflow="ellipsis",
        ))
    return lines


def _window(rows: list[tuple[int | None, Text]], cursor: int, room: int) -> list[Text]:
    """At most `room` rows, scrolled so the cursor's row is inside."""
    if len(rows) <= room:
        return [t for _, t in rows]
    at = next((n for n, (i, _) in enumerate(rows) if i == cursor), 0)
    start = min(max(at - room + 1, 0), len(rows) - room)
    return [t for _, t in rows[start : start + room]]
