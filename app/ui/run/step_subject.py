"""Which decode step the logits panel explains, and how it is labelled.

Live and held: the waiting step, re-filtered by the session under the settings on screen
(no model run). Replay: the recorded step, re-filtered from its recorded candidates when the
settings differ from the recorded ones. Otherwise: the last committed token's own trace.
"""

from __future__ import annotations

import math
from dataclasses import replace

from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import Candidate, StepTrace
from minengine.sampling.trace import explain_candidates
from reqscope.ui.run.frame import StepSubject
from reqscope.ui.run.live import LiveRun
from reqscope.ui.run.replay import ReplayRun
from reqscope.ui.run.view import RunView


def held_subject(live: LiveRun, held: int, params: SamplingParams, path: str = "") -> StepSubject | None:
    """The held step previewed under `params`; its candidates may be picked. `path`: how the step ran."""
    trace = live.preview(params)
    if trace is None:
        return None
    label = f"step {held + 1} waiting · preview (enter picks)"
    return StepSubject(with_grammar_rows(trace), label, pickable=True, path=path)


def replay_subject(replay: ReplayRun, params: SamplingParams) -> StepSubject | None:
    """The recorded step at the cursor, re-filtered when `params` differ from the recorded ones."""
    pending = replay.pending_token()
    if pending is None or pending.trace is None:
        return last_token_subject(replay.view())
    trace, label = pending.trace, f"step {pending.index + 1} · recorded"
    if params != trace.params:
        trace = explain_candidates(
            trace.candidates, params, trace.chosen_id,
            recorded_temperature=trace.params.temperature, vocab_size=trace.vocab_size,
            chosen_piece=trace.chosen_piece, forced=trace.forced,
        )
        # The recorded candidates are the raw logits; what the grammar and the penalties did to them
        # was recorded beside them, and the filters re-run here cannot redo it: keep the record.
        trace = replace(trace, adjustments=pending.trace.adjustments)
        label = f"step {pending.index + 1} · recorded, re-filtered"
    return StepSubject(with_grammar_rows(trace), label, pickable=False)


def last_token_subject(view: RunView) -> StepSubject | None:
    """The trace of the last committed token, if it has one."""
    for token in reversed(view.tokens):
        if token.trace is not None:
            return StepSubject(with_grammar_rows(token.trace), f"token {token.index + 1} committed", pickable=False,
                               path=token.path)  # fmt: skip
    return None


def with_grammar_rows(trace: StepTrace) -> StepTrace:
    """`trace` with the tokens the grammar forbade shown as candidate rows, `× grammar`, at their raw probability.

    A step's candidates are ranked after the grammar's mask: past the allowed tokens they are
    arbitrary tokens at -inf, which say nothing. The likely tokens the grammar took away
    (`GrammarFacts.removed`) say what it did, and may be picked, to see the engine refuse them.
    """
    grammar = trace.adjustments.grammar if trace.adjustments is not None else None
    if grammar is None:
        return trace
    allowed = [c for c in trace.candidates if c.dropped_by == "grammar" or not math.isinf(c.logit)]
    listed = {c.token_id for c in allowed}
    last = allowed[-1].cumulative if allowed else 0.0
    removed = tuple(
        Candidate(r.token_id, r.piece, -math.inf, r.prob, "grammar", last, 0.0) for r in grammar.removed
        if r.token_id not in listed
    )  # fmt: skip
    return replace(trace, candidates=(*allowed, *removed))
