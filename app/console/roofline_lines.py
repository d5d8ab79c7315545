"""The rooflines of a run in the console's words: the keys --json writes, the lines --plain prints.

Each decode step's bytes come with its token event (`TokenEvent.bytes_read`); the ceiling is the
one kept for this machine (`reqscope.bench.ceiling`), with a note of where it came from or what
to run for one. Prefill's roofline (`prefill_keys`) sets the prompt's FLOPs against the compute
ceiling kept for this machine and the model's prefill path (`PrefillFacts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from minengine.engine.events import PrefillEvent, TokenEvent
from minengine.engine.roofline import (
    FEWER_BYTES,
    ComputeCeiling,
    FlopShape,
    ReadCeiling,
    RooflineSummary,
    decode_roofline,
    flop_shape,
    prefill_roofline,
    step_roofline,
)
from minengine.kv.arithmetic import MIB

if TYPE_CHECKING:
    from minengine.engine.engine import Engine


@dataclass(frozen=True)
class PrefillFacts:
    """What prefill's roofline needs beside the run: the model's arithmetic, and the compute ceiling or why none."""

    shape: FlopShape
    compute: ComputeCeiling | None
    note: str


def prefill_facts(engine: Engine) -> PrefillFacts:
    """The model's arithmetic and the compute ceiling kept for this machine and the engine's prefill path."""
    from minengine.plan.compute_ceiling import prefill_path_name
    from reqscope.bench.ceiling import stored_compute_ceiling

    found = stored_compute_ceiling(engine.device, prefill_path_name(engine))
    return PrefillFacts(flop_shape(engine.cfg, engine.model.decode_weight_bytes), found.ceiling, found.note)


def prefill_keys(ev: PrefillEvent, facts: PrefillFacts, read: ReadCeiling | None) -> dict:
    """The done record's `prefill_roofline`: the prefill's FLOPs against the compute ceiling, and the crossover.

    `crossover_rows` (rows a step from which compute binds: compute ceiling over read ceiling, in
    FLOPs per weight byte of a row) is None without both ceilings; `fraction` None without a compute ceiling.
    """
    p = _prefill_of(ev, facts, read)
    c = p.ceiling
    return {
        "computed_tokens": p.tokens,
        "flops": p.flops,
        "flops_per_token": round(p.flops_per_token),
        "attention_flops": p.attention_flops,
        "attention_share": round(p.attention_share, 4),
        "prefill_ms": round(p.prefill_ms, 3),
        "flops_per_s": round(p.flops_per_s),
        "roofline_fraction": None if p.fraction is None else round(p.fraction, 4),
        "step_rows": p.rows,
        "crossover_rows": None if p.crossover is None else round(p.crossover, 2),
        "bound": p.bound,
        "ceiling_flops_per_s": None if c is None else round(c.flops_per_s),
        "ceiling": None if c is None else {k: v for k, v in asdict(c).items() if k != "flops_per_s"},
        "ceiling_note": facts.note,
    }


def token_keys(ev: TokenEvent, ceiling: ReadCeiling | None) -> dict:
    """A token record's roofline keys: what its decode step read, and the time the ceiling allows it.

    All None for the first token (prefill's); the ceiling's keys None without a ceiling.
    """
    read = ev.bytes_read
    if read is None:
        return {"bytes_read": None, "kv_bytes_read": None, "step_ms": round(ev.step_ms, 3), "roofline_ms": None,
                "roofline_fraction": None}  # fmt: skip
    step = step_roofline(read, ev.read_step_ms, ceiling) if ceiling is not None else None
    return {
        "bytes_read": read.total,
        "kv_bytes_read": read.kv,
        "step_ms": round(ev.step_ms, 3),
        "roofline_ms": None if step is None else round(step.roofline_ms, 4),
        "roofline_fraction": None if step is None else round(step.fraction, 4),
    }


def summary_of(tokens: Iterable[TokenEvent], ceiling: ReadCeiling | None) -> RooflineSummary | None:
    """The decode steps among `tokens` against `ceiling`; None when there were none."""
    return decode_roofline(((t.bytes_read, t.read_step_ms) for t in tokens if t.bytes_read is not None), ceiling)


def done_keys(summary: RooflineSummary | None, note: str) -> dict | None:
    """The done record's `roofline`: the mean decode step's bytes and times, and the ceiling they are set against."""
    if summary is None:
        return None
    s, c = summary, summary.ceiling
    return {
        "decode_steps": s.steps,
        "weight_bytes": s.weight_bytes,
        "mean_bytes_read": round(s.mean_bytes_read),
        "mean_kv_bytes_read": round(s.mean_bytes_read - s.weight_bytes),
        "mean_step_ms": round(s.step_ms / s.steps, 4),
        "mean_roofline_ms": None if s.roofline_ms is None else round(s.roofline_ms / s.steps, 4),
        "roofline_fraction": None if s.fraction is None else round(s.fraction, 4),
        "roofline_tokens_per_s": _rounded(s.tokens_per_s_at()),
        "roofline_tokens_per_s_half_weight_bytes": _rounded(s.tokens_per_s_at(FEWER_BYTES)),
        "ceiling_bytes_per_s": None if c is None else round(c.bytes_per_s),
        "ceiling": None if c is None else {"probe": c.probe, "machine": c.machine, "measured_at": c.measured_at,
                                           "source": c.source},  # fmt: skip
        "ceiling_note": note,
    }


def _prefill_of(ev: PrefillEvent, facts: PrefillFacts, read: ReadCeiling | None):
    """`prefill_roofline` of the prefill `ev` reports: the tokens it computed, its widest chunk's rows a step."""
    computed = max(ev.prompt_tokens - ev.reused_tokens, 1)
    rows = max((c.tokens for c in ev.chunks), default=computed)
    return prefill_roofline(facts.shape, computed, ev.reused_tokens, ev.duration_ms, rows, facts.compute, read)


def plain_prefill_lines(ev: PrefillEvent, facts: PrefillFacts, read: ReadCeiling | None) -> list[str]:
    """--plain's prefill roofline, after its prefill line: the FLOPs a token and the FLOP/s reached against the
    compute ceiling (or what to run for one), then the rows from which compute binds and this step's."""
    p = _prefill_of(ev, facts, read)
    reached = f"compute   prefill {p.flops_per_token / 1e9:.3g} GFLOP/token, {p.flops_per_s / 1e9:.1f} GFLOP/s"
    attention = f"attention {p.attention_share:.0%} of the FLOPs"
    if p.fraction is None or p.ceiling is None:
        lines = [f"{reached}; {attention}; {facts.note}"]
    else:
        lines = [f"{reached} = {p.fraction:.0%} of {p.ceiling.flops_per_s / 1e9:.1f} GFLOP/s (compute ceiling: "
                 f"{facts.note}); {attention}"]  # fmt: skip
    if p.crossover is None:
        return [*lines, f"          this step: {p.rows} rows; where compute binds needs both ceilings"]
    binds = crossover_rows_text(p.crossover)
    return [*lines, f"          compute binds from ~{binds} rows a step; this step: {p.rows} rows ({p.bound}-bound)"]


def crossover_rows_text(crossover: float) -> str:
    """The crossover's rows as the console and the explorer print them: to a tenth where a few rows already bind."""
    return f"{crossover:.{1 if crossover < 10 else 0}f}"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def plain_lines(summary: RooflineSummary | None, note: str) -> list[str]:
    """--plain's roofline: the mean step against the ceiling, then what it read and what fewer bytes allow."""
    if summary is None:
        return []
    s = summary
    weights, kv = s.weight_bytes / MIB, (s.mean_bytes_read - s.weight_bytes) / MIB
    read = (f"{s.mean_bytes_read / MIB:.1f} MiB read per step = weights {weights:.1f} ({s.weight_share:.1%}) "
            f"+ KV {kv:.2f}")  # fmt: skip
    if s.ceiling is None or s.roofline_ms is None or s.fraction is None:
        return [f"roofline  {read}; {note}"]
    allowed, measured = s.roofline_ms / s.steps, s.step_ms / s.steps
    return [
        f"roofline  {allowed:.2f} ms/step allowed at {s.ceiling.bytes_per_s / 1e9:.1f} GB/s vs {measured:.2f} ms "
        f"measured: {s.fraction:.0%} of the ceiling (read ceiling: {note})",
        f"          {read}; memory-bound: the ceiling allows {s.tokens_per_s_at():.1f} tok/s, "
        f"{s.tokens_per_s_at(FEWER_BYTES):.1f} with half the weight bytes",
    ]
