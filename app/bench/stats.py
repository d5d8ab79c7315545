"""Summaries of repeated measurements: median with min and max, and per-round ratios.

Rounds alternate the engines being compared, so a ratio is taken within each round (where
both saw the same machine state) and only then summarised; dividing two medians taken at
different moments would let drift between them leak into the ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """Median, minimum and maximum of `n` measurements."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """Summarise `values` (at least one)."""
        if not values:
            raise ValueError("no measurements to summarise")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def scaled(self, factor: float) -> Spread:
        """The same spread with every value multiplied by `factor` (> 0), e.g. to change units."""
        return Spread(self.median * factor, self.min * factor, self.max * factor, self.n)


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round-by-round numerator / denominator (the sequences pair up by round)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators")
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def overhead_percent(instrumented: Sequence[float], bare: Sequence[float]) -> list[float]:
    """Round-by-round slowdown of `instrumented` against `bare`, from rates (higher = faster), in %."""
    return [100.0 * (b / i - 1.0) for i, b in zip(instrumented, bare, strict=True)]


@dataclass(frozen=True)
class Parity:
    """Whether two engines chose the same greedy tokens."""

    tokens: int
    matching_prefix: int

    @property
    def identical(self) -> bool:
        """All tokens agree."""
        return self.matching_prefix == self.tokens


def parity_of(ours: Sequence[int], theirs: Sequence[int]) -> Parity:
    """How many leading tokens agree, out of the longer sequence."""
    prefix = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        prefix += 1
    return Parity(tokens=max(len(ours), len(theirs)), matching_prefix=prefix)
