"""The benchmark's targets, its readable table and its JSON form.

Targets are checked here, on the measured medians, never in timed unit tests: a benchmark can
say "not met on this machine right now" with the figures beside it, a unit test could only
flake. Each target line shows the goal, the value and PASS or FAIL.

The roofline target is read against the matvec probe, the measure the issue states it in ("a
large float32 matrix-vector product here reads about 40 GB/s, so the memory roofline is near
75 tokens/s"). A plain sum streams faster still on some CPUs (here ~20 GB/s against ~16), so
the fraction of that stricter ceiling is printed beside it, never hidden.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minengine.kv.arithmetic import MIB
from reqscope.bench.fair.compare import REQSCOPE, FairComparison
from reqscope.bench.formats import FormatsResult
from reqscope.bench.schedule import BenchReport, Comparison
from reqscope.bench.stats import Spread

DECODE_SPEEDUP_GOAL = 1.5
UNDER_LOAD_KEEPS_GOAL = 0.5  # decode beside one busy process / idle: spinning engines kept 0.1-0.4 here
ROOFLINE_GOAL = 0.60
PREFILL_LONG_SPEEDUP_GOAL = 1.0
EXPLORER_OVERHEAD_GOAL_PERCENT = 5.0
WARM_START_GOAL_S = 3.0


@dataclass(frozen=True)
class Target:
    """One goal of the issue, checked against a measured value."""

    name: str
    goal: str
    value: str
    passed: bool


def targets(report: BenchReport) -> list[Target]:
    """Every target the run can judge (launch targets only when launches ran)."""
    fair = report.fair.decode_speedup
    out = [
        # Stated on the fair comparison: each engine in its own process as its users run it. The
        # in-process figure gave transformers the bench's own PASSIVE policy (2.31x there, 1.12x fairly).
        Target(
            "decode speed vs transformers",
            f">= {DECODE_SPEEDUP_GOAL:.2f}x",
            f"{fair.median:.2f}x",
            fair.median >= DECODE_SPEEDUP_GOAL,
        ),
        Target(
            "decode bandwidth / measured roofline (matvec probe)",
            f">= {ROOFLINE_GOAL:.0%}",
            f"{report.roofline.matvec_fraction.median:.0%} ({report.roofline.fraction.median:.0%} of the faster probe)",
            report.roofline.matvec_fraction.median >= ROOFLINE_GOAL,
        ),
        Target(
            f"prefill of {report.config.long_prompt_tokens} tokens vs transformers",
            f">= {PREFILL_LONG_SPEEDUP_GOAL:.2f}x",
            f"{report.prefill_long.speedup.median:.2f}x",
            report.prefill_long.speedup.median >= PREFILL_LONG_SPEEDUP_GOAL,
        ),
        Target(
            "explorer overhead on decode",
            f"<= {EXPLORER_OVERHEAD_GOAL_PERCENT:.0f}%",
            f"{report.explorer.overhead_percent.median:.1f}%",
            report.explorer.overhead_percent.median <= EXPLORER_OVERHEAD_GOAL_PERCENT,
        ),
        Target(
            "greedy tokens identical to transformers",
            f"{report.parity.tokens} of {report.parity.tokens}",
            f"{report.parity.matching_prefix} of {report.parity.tokens}",
            report.parity.identical,
        ),
        Target(
            "explorer path picks the bare loop's tokens",
            "identical",
            "identical" if report.explorer.same_tokens else "different",
            report.explorer.same_tokens,
        ),
    ]
    if report.fair_under_load is not None:
        idle = report.fair.side(REQSCOPE).decode_tokens_per_s.median
        loaded = report.fair_under_load.side(REQSCOPE).decode_tokens_per_s.median
        out.append(
            Target(
                "decode beside one busy process / idle (no collapse)",
                f">= {UNDER_LOAD_KEEPS_GOAL:.2f}",
                f"{loaded / idle:.2f} ({loaded:.1f} of {idle:.1f} tok/s)",
                loaded >= UNDER_LOAD_KEEPS_GOAL * idle,
            )
        )
    if report.start is not None:
        out.append(
            Target(
                "warm start to first token (reqscope --plain)",
                f"<= {WARM_START_GOAL_S:.1f} s",
                f"{report.start.warm_first_token_s.median:.2f} s",
                report.start.warm_first_token_s.median <= WARM_START_GOAL_S,
            )
        )
        heavy = ", ".join(report.start.heavy_imports)
        out.append(
            Target("plain path imports no UI or transformers", "none", heavy or "none", not report.start.heavy_imports)
        )
    if report.memory is not None:
        m = report.memory
        out.append(
            Target(
                "peak memory of reqscope --plain",
                f"<= {m.budget_bytes / MIB:.0f} MiB",
                f"{m.peak_rss_bytes / MIB:.0f} MiB",
                m.peak_rss_bytes <= m.budget_bytes,
            )
        )
    return out


def _spread(s: Spread, fmt: str = ".2f", scale: float = 1.0) -> str:
    return f"{s.median * scale:{fmt}}  ({s.min * scale:{fmt}} .. {s.max * scale:{fmt}})"


def _cell(value: float | Spread | None, fmt: str, per: float = 1, unit: str = "") -> str:
    """A table cell: `value` (a spread's median) over `per`, formatted; "-" where nothing was measured."""
    if value is None:
        return "-"
    number = value.median if isinstance(value, Spread) else value
    return f"{number / per:{fmt}}{unit}"


def _table(columns: tuple[tuple[str, str], ...], rows: list[tuple[object, ...]]) -> list[str]:
    """A header line of the columns' names, then a line per row: each cell aligned by its column's
    format spec (e.g. ">24"), so the header and the rows cannot drift apart."""
    def line(cells: tuple[object, ...]) -> str:
        return " ".join(f"{cell:{spec}}" for cell, (_name, spec) in zip(cells, columns, strict=True))

    return [line(tuple(name for name, _spec in columns)), *(line(row) for row in rows)]


def _comparison_rows(name: str, c: Comparison, fmt: str) -> list[str]:
    return [
        f"{name:<28} {_spread(c.minengine, fmt):>30} {_spread(c.transformers, fmt):>30}   {_spread(c.speedup)}",
    ]


def format_table(report: BenchReport) -> str:
    """The human-readable report: machine, comparisons, roofline, explorer, start, targets."""
    m, cfg = report.machine, report.config
    lines = [
        f"reqscope bench: {m.model} on {m.device}, {m.dtype}, {m.cpu_count} CPU(s), python {m.python}",
        "",
    ]
    lines += format_fair(report.fair)
    if report.fair_under_load is not None:
        lines += ["", *format_fair(report.fair_under_load)]
    if report.formats is not None:
        lines += ["", *format_formats(report.formats)]
    lines += [
        "",
        "in-process comparison (secondary): both engines inside the benchmark's process, same policy "
        f"(OpenMP wait policy {m.omp_wait_policy}), {m.threads} thread(s)",
        f"load average before {_load(m.load_before)}, after {_load(m.load_after)}; "
        f"torch {m.torch}, transformers {m.transformers}; {cfg.rounds} rounds alternating the engines",
        "medians with (min .. max) over rounds; speedup = minengine speed / transformers speed, per round; "
        f"prefill: best of {cfg.prefill_repeats} per round",
        "",
        f"{'':<28} {'minengine':>30} {'transformers':>30}   speedup",
    ]
    lines += _comparison_rows(f"prefill {report.short_prompt_tokens} tokens (ms)", report.prefill_short, ".1f")
    lines += _comparison_rows(f"prefill {cfg.long_prompt_tokens} tokens (ms)", report.prefill_long, ".1f")
    lines += _comparison_rows(f"decode {cfg.new_tokens} tokens (tok/s)", report.decode, ".2f")
    p = report.parity
    lines.append(f"greedy tokens: {p.matching_prefix} of {p.tokens} identical to transformers")
    r = report.roofline
    lines += [
        "",
        f"roofline: the bare decode loop with a matvec and a sum over {r.probe_bytes / MIB:.0f} MiB after every step, "
        "each clocked alone",
        f"read bandwidth: matvec {_spread(r.probe_matvec_bytes_per_s, '.1f', 1e-9)} GB/s, "
        f"sum {_spread(r.probe_sum_bytes_per_s, '.1f', 1e-9)} GB/s",
        f"decode reads {r.bytes_per_step / MIB:.1f} MiB per step (weights {m.decode_weight_bytes / MIB:.1f} MiB + KV "
        f"{m.kv_bytes_per_token / 1024:.1f} KiB/token); roofline {_spread(r.ceiling_tokens_per_s, '.1f')} tok/s",
        f"decode between the probes {_spread(r.decode_tokens_per_s)} tok/s, reading "
        f"{_spread(r.achieved_bytes_per_s, '.1f', 1e-9)} GB/s = {_spread(r.matvec_fraction, '.0%')} of the "
        f"matvec probe, {_spread(r.fraction, '.0%')} of the faster probe",
    ]
    e = report.explorer
    lines += [
        "",
        f"explorer ({e.tokens} tokens; sampler trace with top-{e.top_n}, KV accounting, timeline): "
        f"{_spread(e.explorer_tokens_per_s)} tok/s vs bare loop {_spread(e.bare_tokens_per_s)} tok/s, "
        f"overhead {_spread(e.overhead_percent, '.1f')} %",
    ]
    if report.start is not None:
        s = report.start
        lines += [
            "",
            f"reqscope --plain to first token: first launch {s.cold_first_token_s:.2f} s "
            "(builds the weight layout cache; page cache not dropped), "
            f"warm {_spread(s.warm_first_token_s)} s over {s.warm_first_token_s.n} launches",
        ]
    if report.memory is not None:
        mem = report.memory
        lines.append(
            f"peak RSS {mem.peak_rss_bytes / MIB:.0f} MiB vs weights {mem.weight_bytes / MIB:.0f} + KV "
            f"{mem.kv_bytes / MIB:.1f} + allowance {mem.allowance_bytes / MIB:.0f} = {mem.budget_bytes / MIB:.0f} MiB"
        )
    if report.device_memory is not None:
        d = report.device_memory
        lines += [
            "",
            f"CUDA: static decode {'on' if d.static_decode else 'off'}, {d.graphs_captured} graph(s) captured, "
            f"decode step {_spread(d.decode_step_ms, '.3f')} ms (CUDA events)",
            f"KV for {cfg.long_prompt_tokens}+{cfg.new_tokens} tokens: memory_allocated "
            f"{d.kv_allocated_bytes / MIB:.2f} MiB, computed {d.kv_computed_bytes / MIB:.2f} MiB "
            f"(logical after prefill {d.kv_logical_bytes / MIB:.2f} MiB)",
        ]
    lines += ["", "targets:"]
    for t in targets(report):
        lines.append(f"  {'PASS' if t.passed else 'FAIL'}  {t.name}: {t.value} (goal {t.goal})")
    return "\n".join(lines)


def format_fair(fair: FairComparison) -> list[str]:
    """The fair comparison's lines: one row per side, its environment, bytes per token, parity."""
    lines = [
        f"fair comparison ({fair.condition}): each engine in its own process as its users run it, "
        f"{fair.rounds} rounds alternating, greedy, up to {fair.new_tokens} tokens, same chat prompt",
        "decode rate from token lines stamped on arrival at the parent, first token excluded; "
        f"load average before {_load(fair.load_before)}, after {_load(fair.load_after)}",
        "first token: the child's own time from the request to its first token, after loading "
        "(prefill rate = prompt tokens / that time)",
        "",
    ]
    columns = (("", "<14"), ("decode tok/s", ">24"), ("vs transformers", ">24"), ("first token ms", ">16"),
               ("prefill tok/s", ">14"), ("tokens", ">7"), ("read/token", ">11"))  # fmt: skip
    lines += _table(columns, [
        (side.name, _spread(side.decode_tokens_per_s, ".1f"), _spread(side.vs_transformers, ".2f"),
         _cell(side.first_token_ms, ".0f"), _cell(side.prefill_tokens_per_s, ".0f"), side.tokens,
         _cell(side.bytes_per_token, ".0f", MIB, " MiB"))
        for side in fair.sides
    ])  # fmt: skip
    lines.append("environments:")
    for side in fair.sides:
        lines.append(f"  {side.name:<12} {side.how}; {side.environment.describe()}")
    p = fair.parity
    lines.append(f"greedy tokens: {p.matching_prefix} of {p.tokens} identical ({REQSCOPE} vs transformers)")
    lines += [f"peer {line}" for line in fair.skipped]
    return lines


def format_formats(result: FormatsResult) -> list[str]:
    """One row per weight format: decode beside transformers and the peer, bytes per step, the
    fraction of the ceiling, both prefills and the peak RSS; then the formats skipped and why."""
    peer = result.peer or "peer"
    long = result.rows[0].long.prompt_tokens if result.rows else 0
    short = (result.rows[0].short_prompt_tokens if result.rows else None) or "?"
    short_head, long_head = f"prefill {short} ms", f"prefill {long} ms"
    lines = [
        "weight formats: each `reqscope --json --weights F` in its own process; decode in the fair comparison's "
        f"rounds, prefill the child's own request-to-first-token ({short}-token chat prompt there, "
        f"{long}-token prompt and one token in launches of their own, which give the peak RSS)",
        f"of ceiling = read/step x decode rate / the matvec probe ({result.ceiling_bytes_per_s / 1e9:.1f} GB/s, "
        "median of the in-process rounds); read/step: what the child reports its decode steps read",
        "",
    ]
    columns = (("", "<9"), ("decode tok/s", ">24"), ("vs transformers", ">16"), ("vs " + peer, ">13"),
               ("read/step", ">10"), ("of ceiling", ">10"), (short_head, ">15"), (long_head, ">17"),
               ("peak RSS", ">9"))  # fmt: skip
    lines += _table(columns, [
        (row.format, _spread(row.decode_tokens_per_s, ".1f"), _cell(row.vs_transformers, ".2f"),
         _cell(row.vs_peer, ".2f"), _cell(row.bytes_per_step, ".0f", MIB, " MiB"), _cell(row.ceiling_fraction, ".0%"),
         _cell(row.prefill_short_ms, ".0f"), _cell(row.long.first_token_ms, ".0f"),
         f"{row.long.peak_rss_bytes / MIB:>5.0f} MiB")
        for row in result.rows
    ])  # fmt: skip
    lines += [f"skipped {skip.format}: {skip.why_not}" for skip in result.skipped]
    return lines


def _load(values: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def to_json(report: BenchReport) -> dict[str, Any]:
    """The report as plain JSON data, with the targets and every derived figure."""
    data = _plain(dataclasses.asdict(report))
    if report.memory is not None:
        data["memory"]["budget_bytes"] = report.memory.budget_bytes
    data["parity"]["identical"] = report.parity.identical
    for key, fair in (("fair", report.fair), ("fair_under_load", report.fair_under_load)):
        if fair is not None:
            data[key]["parity"]["identical"] = fair.parity.identical
            data[key]["decode_speedup"] = dataclasses.asdict(fair.decode_speedup)
            for side, out in zip(fair.sides, data[key]["sides"], strict=True):
                out["prefill_tokens_per_s"] = side.prefill_tokens_per_s
    data["targets"] = [dataclasses.asdict(t) for t in targets(report)]
    return data


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def dumps(report: BenchReport) -> str:
    """`to_json` as indented text."""
    return json.dumps(to_json(report), indent=2)
