"""GQA against MHA and MQA: what the formula says each layout holds, and what runs measured.

The formula rows use the single KV formula (`minengine.kv.arithmetic`) with the model's KV heads,
its query heads (MHA) and one head (MQA). The measured rows come from real runs: the current
request in its layout, and the same request re-run in the other one.
"""

from __future__ import annotations

from dataclasses import dataclass

from minengine.kv.arithmetic import kv_bytes_per_token
from minengine.kv.usage import KVUsage
from minengine.record.trace_io import TraceHeader
from reqscope.ui.run.figures.kv_growth import KVPoint, growth_points
from reqscope.ui.run.figures.latency import LatencyFigures, latency_figures
from reqscope.ui.run.view import RunView


@dataclass(frozen=True)
class FormulaRow:
    """One layout's KV size by formula, at the current token count."""

    name: str
    heads: int
    bytes_per_token: int
    bytes_now: int


@dataclass(frozen=True)
class MeasuredLayout:
    """What one run in one cache layout measured."""

    layout: str  # "gqa" or "mha", as the engine names its cache layouts
    request_id: str
    tokens: int
    bytes_per_token: int
    logical_bytes: int
    physical_bytes: int
    itl_mean_ms: float | None
    decode_tokens_per_s: float | None
    finished: bool
    growth: tuple[KVPoint, ...] = ()  # the cache after prefill and each token (thinned), for the growth chart


def element_bytes(kv: KVUsage) -> float:
    """Bytes per stored K or V element, recovered from the measured per-token size."""
    return kv.bytes_per_token / (2 * kv.layers * kv.stored_heads * kv.head_dim)


def formula_rows(header: TraceHeader, kv: KVUsage) -> tuple[FormulaRow, ...]:
    """The model's own layout, MHA and MQA by formula, at `kv.tokens` cached tokens."""
    elem = element_bytes(kv)
    own = "GQA" if 1 < header.kv_heads < header.q_heads else ("MQA" if header.kv_heads == 1 else "MHA")
    rows = []
    for name, heads in ((own, header.kv_heads), ("MHA", header.q_heads), ("MQA", 1)):
        if rows and heads in (r.heads for r in rows):
            continue  # an MHA or MQA model has fewer distinct layouts to compare
        per_token = kv_bytes_per_token(header.layers, heads, header.head_dim, elem)
        rows.append(FormulaRow(name, heads, per_token, per_token * kv.tokens))
    return tuple(rows)


def measured_layout(view: RunView, request_id: str, figures: LatencyFigures | None = None) -> MeasuredLayout | None:
    """The current run's measurement, once it holds a KV snapshot (`figures`: its latency, if known).

    Its ITL and decode rate are on the engine's clock, so a run stepped by hand compares with
    one that ran freely.
    """
    kv = view.kv
    if kv is None:
        return None
    figures = figures or latency_figures(view)
    metrics = figures.engine
    return MeasuredLayout(
        layout=kv.layout,
        request_id=request_id,
        tokens=kv.tokens,
        bytes_per_token=kv.bytes_per_token,
        logical_bytes=kv.logical_bytes,
        physical_bytes=kv.physical_bytes,
        itl_mean_ms=figures.itl.mean if figures.itl else None,
        decode_tokens_per_s=metrics.decode_output_tokens_per_second if metrics else None,
        finished=view.done,
        growth=growth_points(view),
    )
