"""One request's stages before the sampler's filters, and the token each step commits.

vLLM 0.32's CPU runner changes a row's logits in this order before temperature and the filters:

1. the grammar's bitmask (`sampling.grammar`), forbidden tokens to -inf;
2. min_tokens: the end tokens (EOS and `stop_token_ids`) to -inf until that many are out;
3. logit bias;
4. the penalties: repetition (prompt and output), then frequency, then presence (output only).

Then the filter chain runs in `params.order` (`sampling.chain`). `LogitStages` keeps what those
stages need from step to step (the prompt's ids, the output's counts, the grammar's matcher) and is
advanced by every token the request commits, sampled or forced. The explorer's session and the
step loop's chooser (`engine.run_ahead`) both pick through it, so a request's token is the same
whichever of them chose it; a preempted request recomputes its positions but never re-commits a
token, so nothing is counted twice.

A steered request's grammar may be turned off and on again between steps (`grammar_off`,
`grammar_on`): on again, a new matcher is fed the output so far, and refused if it does not fit.
The grammar is read once per use, so a switch made from another thread (the UI's, while the
step is held) is seen whole or not at all.

The untraced path does nothing extra when no stage is on (a plain request samples from the
model's own row, as before); the traced one also says what the stages did (`Adjustments`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from minengine.errors import RequestError
from minengine.sampling.chain import NEG_INF, as_row, top_values
from minengine.sampling.grammar import GrammarMatcher
from minengine.sampling.logit_summary import LogitSummary
from minengine.sampling.params import SamplingParams
from minengine.sampling.penalties import add_logit_bias, frequency_and_presence, repetition_penalty
from minengine.sampling.sampler import Sampler, argmax_id
from minengine.sampling.step_trace import Adjustments, GrammarFacts, RankChange, RemovedToken, StepTrace
from minengine.threads import OneThread

REMOVED_SHOWN = 5  # the grammar's most likely forbidden tokens a trace names


class LogitStages:
    """A request's grammar, min_tokens, bias and penalties over its steps, with its sampler."""

    def __init__(
        self,
        sampler: Sampler,
        piece: Callable[[int], str],
        *,
        prompt_ids: Iterable[int] = (),
        end_ids: Iterable[int] = (),
        min_tokens: int = 0,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """`end_ids`: the tokens min_tokens holds back (EOS and the request's stop_token_ids)."""
        self.sampler, self.piece, self.grammar = sampler, piece, grammar
        self.end_ids = tuple(sorted(set(end_ids)))
        self.min_tokens = min_tokens
        self.count = 0  # tokens committed so far
        self.output: list[int] = []  # the tokens committed, in order: what a grammar turned on again replays
        self._seen: dict[int, None] = dict.fromkeys(prompt_ids)  # prompt and output, in first-seen order
        self._counts: dict[int, int] = {}  # output token -> times committed
        self._seen_ids: torch.Tensor | None = None  # `_seen` as a tensor, until it grows
        self._count_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # `_counts` as tensors, until the next token
        self._bias: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (params' pairs, ids, values)

    # -- committing ---------------------------------------------------------------------------------

    def accept(self, token: int) -> None:
        """Advance past `token`, the request's next committed one."""
        self.count += 1
        self.output.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        self._count_ids = None
        if token not in self._seen:
            self._seen[token] = None
            self._seen_ids = None
        grammar = self.grammar
        if grammar is not None:
            grammar.accept(token)

    def refuse_forbidden(self, token: int) -> None:
        """Raise RequestError when the grammar does not let `token` come next (a forced pick)."""
        grammar = self.grammar
        if grammar is not None and not grammar.allows(token):
            raise RequestError(
                f"token {token} ({self.piece(token)!r}) is not allowed by the {grammar.grammar.describe} "
                f"grammar here ({grammar.state()}); pick a token it allows"
            )

    # -- the grammar switched off and on ------------------------------------------------------------

    def grammar_off(self) -> None:
        """Drop the grammar: the next steps are free (min_tokens, bias and penalties still apply)."""
        self.grammar = None

    def grammar_on(self, matcher: GrammarMatcher, forced: int | None = None) -> None:
        """Constrain the next steps by `matcher`, a fresh one, once it has taken every token
        committed so far, in order (and allows `forced`, a pick waiting for the next step).

        Raises RequestError, naming the first token that does not fit, and leaves the stages as they were.
        """
        taken = matcher.replay(self.output)
        what = matcher.grammar.describe
        if taken < len(self.output):
            token = self.output[taken]
            n = len(self.output)
            raise RequestError(
                f"the {n} token{'s' if n != 1 else ''} already generated do not fit the {what} grammar at "
                f"token {taken + 1} ({self.piece(token)!r}); the grammar stays off"
            )
        if forced is not None and not matcher.allows(forced):
            raise RequestError(
                f"the token picked for the next step, {forced} ({self.piece(forced)!r}), is not allowed by the "
                f"{what} grammar there; the grammar stays off"
            )
        self.grammar = matcher

    def pick(
        self,
        logits: torch.Tensor,
        *,
        traced: bool,
        top_n: int = 20,
        force: int | None = None,
        summary: LogitSummary | None = None,
    ) -> tuple[int, StepTrace | None]:
        """The step's token through the stages and the sampler (or `force`, the generator still
        advancing as if drawn), its trace when `traced`; the token is committed (`accept`)."""
        row = as_row(logits)
        params = self.sampler.params
        with OneThread(row.device):
            trace = None
            if traced:
                adjusted, adjustments = self.adjust_traced(row, params, top_n)
                token, trace = self.sampler.sample_traced(adjusted, self.piece, top_n, force=force, summary=summary)
                if adjustments is not None:
                    trace = dataclasses.replace(trace, adjustments=adjustments)
            else:
                token = self.sampler.sample(self.adjust(row, params))
                token = force if force is not None else token
        self.accept(token)
        return token, trace

    # -- the stages ---------------------------------------------------------------------------------

    def _holds_ends(self, grammar: GrammarMatcher | None) -> bool:
        """Whether min_tokens masks the end tokens this step. Not once the grammar is done: then
        the end of turn is the only token left, and masking it would leave nothing to sample."""
        return self.count < self.min_tokens and bool(self.end_ids) and not (grammar is not None and grammar.done)

    def on(self, params: SamplingParams) -> bool:
        """Whether any stage changes this step's logits."""
        grammar = self.grammar
        return grammar is not None or self._holds_ends(grammar) or params.adjusts_logits

    def adjust(self, row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """`row` as the filters see it: a changed copy, or `row` itself when no stage is on (the
        model's own logits stay as they are: what a preview and logprobs read)."""
        grammar = self.grammar
        if not (grammar is not None or self._holds_ends(grammar) or params.adjusts_logits):
            return row
        out = grammar.masked(row) if grammar is not None else row.clone()
        if self._holds_ends(grammar):
            out[self._end_tensor(out)] = NEG_INF
        self._bias_and_penalties(out, params)
        return out

    def adjust_traced(
        self, row: torch.Tensor, params: SamplingParams, top_n: int
    ) -> tuple[torch.Tensor, Adjustments | None]:
        """`adjust`, and what each stage did to the row (None when no stage is on)."""
        grammar = self.grammar
        if not (grammar is not None or self._holds_ends(grammar) or params.adjusts_logits):
            return row, None
        out = grammar.masked(row) if grammar is not None else row.clone()
        facts = None
        if grammar is not None:
            facts = self._grammar_facts(grammar, row, out)
        masked_ends = 0
        if self._holds_ends(grammar):
            ends = self._end_tensor(out)
            out[ends] = NEG_INF
            masked_ends = ends.numel()
        changes: tuple[RankChange, ...] = ()
        if params.adjusts_logits:
            before = out.clone()
            self._bias_and_penalties(out, params)
            changes = rank_changes(before, out, top_n, self.piece)
        raw_winner, winner = argmax_id(row), argmax_id(out)
        moved = raw_winner != winner
        return out, Adjustments(
            grammar=facts,
            min_tokens_masked=masked_ends,
            changes=changes,
            winner_before=raw_winner if moved else None,
            winner_after=winner if moved else None,
        )

    def _end_tensor(self, row: torch.Tensor) -> torch.Tensor:
        ends = [i for i in self.end_ids if i < row.numel()]
        return torch.tensor(ends, dtype=torch.long, device=row.device)

    def _bias_and_penalties(self, out: torch.Tensor, params: SamplingParams) -> None:
        if params.logit_bias:
            if self._bias is None or self._bias[0] != params.logit_bias or self._bias[1].device != out.device:
                ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=out.device)
                values = torch.tensor([v for _, v in params.logit_bias], dtype=torch.float32, device=out.device)
                self._bias = (params.logit_bias, ids, values)
            add_logit_bias(out, self._bias[1], self._bias[2])
        if params.repetition_penalty != 1 and self._seen:
            if self._seen_ids is None or self._seen_ids.device != out.device:
                self._seen_ids = torch.tensor(list(self._seen), dtype=torch.long, device=out.device)
            repetition_penalty(out, self._seen_ids, params.repetition_penalty)
        if (params.frequency_penalty != 0 or params.presence_penalty != 0) and self._counts:
            if self._count_ids is None or self._count_ids[0].device != out.device:
                ids = torch.tensor(list(self._counts), dtype=torch.long, device=out.device)
                counts = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=out.device)
                self._count_ids = (ids, counts)
            frequency_and_presence(out, *self._count_ids, params.frequency_penalty, params.presence_penalty)

    def _grammar_facts(self, grammar: GrammarMatcher, raw: torch.Tensor, masked: torch.Tensor) -> GrammarFacts:
        """What the mask took from the raw distribution: the likeliest forbidden tokens, their mass."""
        probs = torch.softmax(raw, dim=-1)
        forbidden = probs.masked_fill(masked != NEG_INF, 0.0)
        shown, ids = top_values(forbidden, min(REMOVED_SHOWN, forbidden.numel()))
        removed = tuple(
            RemovedToken(int(i), self.piece(int(i)), float(p))
            for p, i in zip(shown.tolist(), ids.tolist(), strict=True)
            if p > 0
        )
        return GrammarFacts(
            allowed=int(torch.count_nonzero(masked != NEG_INF)),
            vocab_size=raw.numel(),
            removed=removed,
            mass_removed=float(forbidden.sum(dtype=torch.float64)),
            state=grammar.state(),
        )


def rank_changes(
    before: torch.Tensor, after: torch.Tensor, top_n: int, piece: Callable[[int], str]
) -> tuple[RankChange, ...]:
    """The tokens among the top `top_n` (before or after) whose rank moved from `before` to `after`,
    best after first. A rank is 1 + the number of strictly larger logits in the whole row."""
    k = min(top_n, before.numel())
    ids = torch.unique(torch.cat((top_values(before, k)[1], top_values(after, k)[1])))
    ranks = []
    for row in (before, after):
        values = row[ids]
        ranks.append((1 + (row.unsqueeze(0) > values.unsqueeze(1)).sum(dim=1)).tolist())
    out = [
        RankChange(int(t), piece(int(t)), rb, ra, float(before[t]), float(after[t]))
        for t, rb, ra in zip(ids.tolist(), ranks[0], ranks[1], strict=True)
        if rb != ra
    ]
    return tuple(sorted(out, key=lambda c: (c.rank_after, c.token_id)))
