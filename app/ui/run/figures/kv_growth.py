"""KV bytes against cached tokens over one request, as measured: the points the growth chart draws.

The points are the cache snapshots the engine reports after prefill and with every token
(`KVUsage`), logical and block-rounded physical. The chart (the KV panel) draws them beside
the other layouts by formula (`layout_compare.formula_rows`) and, once the same request has run
in the other layout (the `m` key), that run's points (`MeasuredLayout.growth`).

A chart needs no more points than it has dot columns, so a run's points are thinned to
`MAX_POINTS`, whatever its length: a repaint costs the same at token 10 and token 10,000.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.kv.usage import KVUsage
from reqscope.ui.run.view import RunView

MAX_POINTS = 512


@dataclass(frozen=True)
class KVPoint:
    """The cache at one moment: how many tokens it held, logical and physical bytes."""

    tokens: int
    logical_bytes: int
    physical_bytes: int


def growth_points(view: RunView, limit: int = MAX_POINTS) -> tuple[KVPoint, ...]:
    """The cache after prefill and after each token, thinned evenly to at most `limit` points (the last kept)."""
    snapshots: list[KVUsage] = []
    count = len(view.tokens) + (1 if view.prefill else 0)
    if count == 0:
        return ()
    stride = max(1, -(-count // limit))
    for n in range(0, count, stride):
        snapshots.append(_snapshot(view, n))
    if (count - 1) % stride:
        snapshots.append(_snapshot(view, count - 1))
    return tuple(KVPoint(kv.tokens, kv.logical_bytes, kv.physical_bytes) for kv in snapshots)


def _snapshot(view: RunView, n: int) -> KVUsage:
    """The n-th snapshot: prefill's first (when seen), then the tokens'."""
    if view.prefill is not None:
        return view.prefill.kv if n == 0 else view.tokens[n - 1].kv
    return view.tokens[n].kv
