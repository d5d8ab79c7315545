"""What the stages before the filters did to one step, in lines: the grammar's mask, min_tokens,
logit bias and the penalties (`StepTrace.adjustments`), shared by the logits panel and `--plain`.

The grammar's line says how many tokens it allowed of the vocabulary, the likely tokens it took
away and their probability mass, and where the grammar is; the bias and penalties' line says
which tokens they moved in rank, and whether the winner changed.
"""

from __future__ import annotations

from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import Adjustments, GrammarFacts, RankChange, StepTrace
from reqscope.ui.glyphs import show_piece

REMOVED_SHOWN = 5  # the grammar's removed tokens named on its line
CHANGES_SHOWN = 4  # the rank changes named on the bias and penalties' line
SHOWN_PROB = 0.0005  # a removed token shown below this rounds to 0.0%: it says nothing


def stages_before(params: SamplingParams, adjustments: Adjustments | None) -> list[str]:
    """The stages that ran before the filters this step, in vLLM's order, each with its value."""
    stages: list[str] = []
    if adjustments is not None and adjustments.grammar is not None:
        stages.append("grammar")
    if adjustments is not None and adjustments.min_tokens_masked:
        stages.append("min_tokens")
    if params.logit_bias:
        stages.append(f"bias {len(params.logit_bias)} token{'s' if len(params.logit_bias) != 1 else ''}")
    if params.repetition_penalty != 1:
        stages.append(f"repetition {params.repetition_penalty:g}")
    if params.frequency_penalty:
        stages.append(f"frequency {params.frequency_penalty:g}")
    if params.presence_penalty:
        stages.append(f"presence {params.presence_penalty:g}")
    return stages


def grammar_line(grammar: GrammarFacts) -> str:
    """`grammar: 12 of 49,152 tokens allowed · removed 97.1% of the mass · inside a string`."""
    return (
        f"grammar: {grammar.allowed:,} of {grammar.vocab_size:,} tokens allowed · removed "
        f"{grammar.mass_removed:.1%} of the mass · {grammar.state}"
    )


def removed_line(grammar: GrammarFacts, shown: int = REMOVED_SHOWN) -> str | None:
    """`  removed: I 41.2%, Here 10.3%, ...`, the likeliest tokens it forbade; None when none was likely."""
    likely = [r for r in grammar.removed if r.prob >= SHOWN_PROB]
    if not likely:
        return None
    named = ", ".join(f"{show_piece(r.piece, 10)} {r.prob:.1%}" for r in likely[:shown])
    more = f", +{len(likely) - shown} more" if len(likely) > shown else ""
    return f"  removed: {named}{more}"


def min_tokens_line(adjustments: Adjustments) -> str | None:
    """`min_tokens: 1 end token masked`, while min_tokens are not out; None otherwise."""
    n = adjustments.min_tokens_masked
    return f"min_tokens: {n} end token{'s' if n != 1 else ''} masked (min_tokens not out yet)" if n else None


def rank_line(adjustments: Adjustments, shown: int = CHANGES_SHOWN) -> str | None:
    """`bias/penalties: the #9 -> #1, a #1 -> #2`, the farthest moves first; None when they moved no rank."""
    if not adjustments.changes:
        return None
    # The farthest moves first: the token a penalty pushed down (or a bias pulled up), not its neighbours
    # that each moved up one place behind it.
    ranked = sorted(adjustments.changes, key=lambda c: (-abs(c.rank_after - c.rank_before), c.rank_after))
    moved = ", ".join(_change(c) for c in ranked[:shown])
    more = f", +{len(adjustments.changes) - shown} more" if len(adjustments.changes) > shown else ""
    return f"bias/penalties: {moved}{more}"


def winner_line(trace: StepTrace) -> str | None:
    """`winner changed: a -> the (by the grammar)` when the stages changed the argmax, else None."""
    adjustments = trace.adjustments
    if adjustments is None:
        return None
    before, after = adjustments.winner_before, adjustments.winner_after
    if before is None or after is None or before == after:
        return None
    pieces = _pieces(trace)
    return f"winner changed: {_named(before, pieces)} -> {_named(after, pieces)}"


def adjustment_lines(trace: StepTrace) -> list[str]:
    """Every line above for one step, in the stages' order (none when no stage before the filters ran)."""
    adjustments = trace.adjustments
    if adjustments is None:
        return []
    lines: list[str | None] = []
    if adjustments.grammar is not None:
        lines += [grammar_line(adjustments.grammar), removed_line(adjustments.grammar)]
    lines += [min_tokens_line(adjustments), rank_line(adjustments), winner_line(trace)]
    return [line for line in lines if line is not None]


def _pieces(trace: StepTrace) -> dict[int, str]:
    """Every token's piece the step's record names: its candidates, what the grammar removed, the moved ones."""
    assert trace.adjustments is not None
    grammar = trace.adjustments.grammar
    pieces = {c.token_id: c.piece for c in trace.candidates}
    pieces |= {r.token_id: r.piece for r in (grammar.removed if grammar is not None else ())}
    pieces |= {c.token_id: c.piece for c in trace.adjustments.changes}
    pieces[trace.chosen_id] = trace.chosen_piece
    return pieces


def _change(c: RankChange) -> str:
    return f"{show_piece(c.piece, 10)} #{c.rank_before} -> #{c.rank_after}"


def _named(token_id: int, pieces: dict[int, str]) -> str:
    return show_piece(pieces[token_id], 10) if token_id in pieces else f"id {token_id}"
