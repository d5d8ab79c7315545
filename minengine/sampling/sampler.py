"""The sampler: draw one token per decode step under SamplingParams, optionally with a trace.

Greedy (temperature 0) bypasses the chain: the argmax of the raw logits. `torch.multinomial`
draws one exponential per vocabulary entry, so by default the token is drawn by inverse CDF from
a single uniform; the distribution sampled from is the same, only the mapping from random
numbers to tokens differs (`draw="multinomial"` restores HF's token-for-token behaviour at its
price). The filter stages live in `chain`, the traces in `trace`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Literal

import torch

from minengine.sampling.chain import Live, as_row, final_distribution, over_row, run_chain
from minengine.sampling.logit_summary import LogitSummary
from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import StepTrace
from minengine.sampling.trace import build_trace, check_token, greedy_trace
from minengine.threads import OneThread

DrawMethod = Literal["inverse_cdf", "multinomial"]


def argmax_id(logits: torch.Tensor) -> int:
    """The id of the first largest logit, a NaN counting as the largest (torch.argmax's answer).

    On the CPU numpy's vectorised argmax gives it: torch's reduction took 40 us over a 49,152-entry
    row against numpy's 4 (one thread, 2-core AMD EPYC), and 8 requests decoding together each
    take one between two shared steps.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))

# -- sampling ------------------------------------------------------------------------------------


class Sampler:
    """Draws one token per decode step under SamplingParams, with its own seeded generator.

    `sample` and `sample_traced` run the same chain and consume the generator identically, so
    tracing never changes which token is drawn. Greedy steps draw nothing. Both run on one
    thread: each of their passes over a vocabulary row is too short to pay for waking another
    (the traced step measured 4.7 ms on two threads between decode steps).
    """

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device | str = "cpu",
        draw: DrawMethod = "inverse_cdf",
    ) -> None:
        params.validate()
        if draw not in ("inverse_cdf", "multinomial"):
            raise ValueError(f"draw must be 'inverse_cdf' or 'multinomial'; got {draw!r}")
        self.params = params
        self.device = torch.device(device)
        self.draw = draw
        # One uniform per step is drawn on the CPU, so a seed gives the same draws on any
        # device; multinomial must draw on the device that holds the probabilities.
        self._generator = torch.Generator(device=self.device if draw == "multinomial" else "cpu")
        self.seed = self._reseed(params.seed)

    def _reseed(self, seed: int | None) -> int:
        seed = secrets.randbits(63) if seed is None else seed
        self._generator.manual_seed(seed)
        return seed

    def update(self, params: SamplingParams) -> None:
        """Use `params` for the next steps; the generator restarts only when given a new seed."""
        params.validate()
        if params.seed is not None and params.seed != self.params.seed:
            self.seed = self._reseed(params.seed)
        self.params = params

    def _draw(self, final: Live, ids: torch.Tensor | None, probs: torch.Tensor) -> tuple[int, float | None]:
        """One token from the chain's result; returns (token, uniform drawn or None)."""
        if self.draw == "multinomial":  # HF's exact call, on HF's full-row probabilities
            row_probs = torch.softmax(final.scores, dim=-1)
            return int(torch.multinomial(row_probs, 1, generator=self._generator)), None
        u = float(torch.rand((), generator=self._generator, dtype=torch.float64))
        cdf = probs.cumsum(dim=0, dtype=torch.float64)
        total = float(cdf[-1])
        if not math.isfinite(total) or total <= 0:
            raise ValueError("the sampler got logits with no finite maximum (NaN or all -inf)")
        index = int(torch.searchsorted(cdf, u * total, right=True))
        if index == probs.numel():  # u * total rounded up to total: take the last live entry
            index = int(torch.searchsorted(cdf, total))
        return (index if ids is None else int(ids[index])), u

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id (the hot path: no trace is built)."""
        with OneThread(logits.device):
            return self._sample(as_row(logits))

    def _sample(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return argmax_id(logits)
        final = run_chain(logits, self.params).final
        return self._draw(final, *final_distribution(final))[0]

    def sample_traced(
        self,
        logits: torch.Tensor,
        piece: Callable[[int], str],
        top_n: int = 20,
        force: int | None = None,
        summary: LogitSummary | None = None,
    ) -> tuple[int, StepTrace]:
        """The next token id and the trace explaining it.

        With `force`, that token is committed instead, but the generator still advances
        exactly as if a token had been drawn, so later steps draw the same random numbers
        whether or not an earlier one was forced. A greedy step reads `summary` (of these very
        logits, made in the step) instead of computing it.
        """
        with OneThread(logits.device):
            return self._sample_traced(as_row(logits), piece, top_n, force, summary)

    def _sample_traced(
        self,
        logits: torch.Tensor,
        piece: Callable[[int], str],
        top_n: int,
        force: int | None,
        summary: LogitSummary | None = None,
    ) -> tuple[int, StepTrace]:
        n = logits.numel()
        if force is not None:
            check_token(force, n)
        if self.params.greedy:
            trace = greedy_trace(logits, self.params, force, piece, top_n, force is not None, summary)
            if trace is not None:
                return trace.chosen_id, trace
        run = run_chain(logits, self.params)
        ids, probs = final_distribution(run.final)
        if self.params.greedy:
            chosen, uniform = int(run.final.alive[0]), None
        else:
            chosen, uniform = self._draw(run.final, ids, probs)
        if force is not None:
            chosen = force
        trace = build_trace(
            logits,
            self.params,
            run,
            over_row(ids, probs, n),
            chosen,
            piece,
            top_n,
            force is not None,
            uniform,
        )
        return chosen, trace
