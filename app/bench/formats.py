"""Each weight format as its own `reqscope --json --weights F` process, beside transformers and llama.cpp.

The explorer's format is the fair comparison's `reqscope` side; every other format this machine
runs is a side of its own there (`reqscope fp16`, ...), launched, alternated and timed from
outside exactly as the others, so its decode rate sits beside transformers' and llama.cpp's in
the same rounds. Its bytes per step are what the child reports for each decode step (the
engine's own account, `bytes_read` in `--json`), and the fraction of the bandwidth ceiling is
those bytes at its decode rate over the matvec probe measured in the same benchmark. Prefill is
the child's own request-to-first-token time: the fair runs give the short chat prompt's, and
launches with a long prompt and one token give the long one's (and the peak RSS of a run that
holds it). A format the machine lacks is a skipped line with the engine's reason, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minengine.dtype_names import WEIGHT_FORMATS
from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from reqscope.bench.fair.compare import REQSCOPE, TRANSFORMERS, FairComparison, SideResult
from reqscope.bench.fair.pipes import StreamedRun, stream_run
from reqscope.bench.stats import Spread
from reqscope.other_formats import FormatOption, other_formats

EVERY_FORMAT = ("all",)  # the flag's default: every format this machine runs


@dataclass(frozen=True)
class FormatPlan:
    """The formats to run besides the engine's own, and those skipped."""

    formats: tuple[str, ...]
    skipped: tuple[FormatOption, ...]  # each with the engine's reason


@dataclass(frozen=True)
class LongPrefill:
    """One format's long-prompt launches: the child's prefill time and its peak RSS."""

    prompt_tokens: int
    first_token_ms: Spread
    peak_rss_bytes: int


@dataclass(frozen=True)
class FormatRow:
    """One weight format's figures, each from its own processes."""

    format: str
    side: str  # its side in the fair comparison
    decode_tokens_per_s: Spread
    vs_transformers: Spread  # per round
    vs_peer: float | None  # median decode rate over the first peer's (llama.cpp), when one ran
    bytes_per_step: float | None  # the child's own report, mean over the decode steps
    ceiling_fraction: float | None  # bytes per step x median decode rate / the matvec probe
    short_prompt_tokens: int | None
    prefill_short_ms: Spread | None  # the fair runs' request-to-first-token
    long: LongPrefill


@dataclass(frozen=True)
class FormatsResult:
    """Every weight format's row, what was skipped, and the ceiling the fractions are of."""

    rows: tuple[FormatRow, ...]
    skipped: tuple[FormatOption, ...]
    ceiling_bytes_per_s: float
    peer: str | None  # the peer `vs_peer` is against


def side_name(fmt: str, engine: Engine) -> str:
    """The fair comparison's name for a format's side: the explorer's own is `reqscope`."""
    return REQSCOPE if fmt == engine.weights.format else f"{REQSCOPE} {fmt}"


def plan_formats(asked: tuple[str, ...], engine: Engine) -> FormatPlan:
    """The formats of `asked` (`EVERY_FORMAT`: all) other than `engine`'s, each checked as the engine would."""
    options = other_formats(engine, WEIGHT_FORMATS if asked == EVERY_FORMAT else asked)
    return FormatPlan(tuple(o.format for o in options if o.runs), tuple(o for o in options if not o.runs))


def long_prompt_text(engine: Engine, tokens: int, ids_of: Callable[[Engine, int], list[int]]) -> str:
    """Plain text whose chat-templated prompt is about `tokens` tokens (`ids_of(engine, n)`: n ids of text)."""
    tok = engine.tokenizer
    overhead = len(tok.encode(tok.render(list(GenerationRequest.from_prompt("x").messages)))) - 1
    return tok.decode(ids_of(engine, max(tokens - overhead, 1)))


def long_prefills(
    commands: dict[str, tuple[str, ...]],
    env: dict[str, str],
    rounds: int,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, LongPrefill]:
    """Each format's long-prompt command, `rounds` times in alternating order, its memory watched."""
    runs: dict[str, list[StreamedRun]] = {fmt: [] for fmt in commands}
    order = list(commands)
    for r in range(rounds):
        progress(f"weight formats: long prefill, round {r + 1} of {rounds}")
        for fmt in order if r % 2 == 0 else order[::-1]:
            runs[fmt].append(stream_run(f"{REQSCOPE} --weights {fmt}", commands[fmt], env, watch_memory=True))
    return {fmt: _long(fmt, done) for fmt, done in runs.items()}


def _long(fmt: str, runs: list[StreamedRun]) -> LongPrefill:
    firsts = [run.first_token_ms for run in runs if run.first_token_ms is not None]
    if not firsts:
        raise ReqscopeError(f"reqscope --weights {fmt} reported no first-token time for the long prompt")
    return LongPrefill(runs[0].prompt_tokens or 0, Spread.of(firsts), max(run.peak_rss_bytes or 0 for run in runs))


def format_rows(
    fair: FairComparison,
    names: dict[str, str],
    long: dict[str, LongPrefill],
    skipped: tuple[FormatOption, ...],
    ceiling_bytes_per_s: float,
) -> FormatsResult:
    """The rows, from the fair comparison's sides (`names`: format -> side) and the long launches."""
    peers = [s for s in fair.sides if s.name != TRANSFORMERS and not s.name.startswith(REQSCOPE)]
    peer = peers[0] if peers else None
    rows = tuple(_row(fmt, fair.side(side), long[fmt], peer, ceiling_bytes_per_s) for fmt, side in names.items())
    return FormatsResult(rows, skipped, ceiling_bytes_per_s, peer.name if peer else None)


def _row(fmt: str, side: SideResult, long: LongPrefill, peer: SideResult | None, ceiling: float) -> FormatRow:
    rate = side.decode_tokens_per_s.median
    fraction = side.bytes_per_token * rate / ceiling if side.bytes_per_token and ceiling > 0 else None
    return FormatRow(
        format=fmt,
        side=side.name,
        decode_tokens_per_s=side.decode_tokens_per_s,
        vs_transformers=side.vs_transformers,
        vs_peer=rate / peer.decode_tokens_per_s.median if peer is not None else None,
        bytes_per_step=side.bytes_per_token,
        ceiling_fraction=fraction,
        short_prompt_tokens=side.prompt_tokens,
        prefill_short_ms=side.first_token_ms,
        long=long,
    )
