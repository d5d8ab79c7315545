"""The run added up: vLLM's figures, its summary block word for word, and its result file's keys.

Counting follows `vllm bench serve`: a closed cohort over the run's window (every request sent
is inside it), throughputs over successful requests only, TTFT and E2EL per request, TPOT per
request with more than one output token, ITL over every gap of every request. Per request the
figures are the seeds' (`minengine.engine.metrics`, through `stream`); their distributions use
its summary too (`itl_stats`: mean, median, population std, p99 by numpy's linear rule), so
a P99 here reads as vLLM's. Input tokens are the server's `usage.prompt_tokens` where it sends
them: a chat route counts its template's tokens too. A structured-output run adds what vLLM's
block lacks: how many answers follow the format asked for (`answers`), and how many were cut by
length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minengine.engine.metrics import ItlStats, itl_stats
from minengine.sampling.structured import StructuredOutput
from reqscope.bench.serve.answers import AnswerTally, tally_answers
from reqscope.bench.serve.load import LoadRun
from reqscope.bench.serve.stream import RequestOutcome

_WIDTH = 50
# (key in vLLM's names, name in the block, the block's section header)
_LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass(frozen=True)
class BenchSetup:
    """What the run was asked to do, as its result file records it."""

    base_url: str
    endpoint: str
    model: str
    tokenizer: str
    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float  # inf: every request at once
    burstiness: float
    max_concurrency: int | None
    seed: int
    every_chunk: bool = False  # every chunk with a choice timed (vLLM's client), not visible text alone
    structured: StructuredOutput | None = None  # the response_format every request asked for
    output_lens_from: str | None = None  # the earlier result each request's output length came from


@dataclass(frozen=True)
class ServeBenchResult:
    """The figures of one run; latencies in ms, None when no request gave one."""

    setup: BenchSetup
    duration_s: float
    completed: int
    failed: int
    first_error: str | None
    total_input_tokens: int
    total_output_tokens: int
    ttft: ItlStats | None
    tpot: ItlStats | None
    itl: ItlStats | None
    e2el: ItlStats | None
    outcomes: tuple[RequestOutcome, ...]
    answers: AnswerTally | None = None  # a structured-output run's checks

    @property
    def request_throughput(self) -> float:
        """Successful requests per second of the run."""
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        """Output tokens of successful requests per second."""
        return self.total_output_tokens / self.duration_s

    @property
    def total_token_throughput(self) -> float:
        """Input and output tokens of successful requests per second."""
        return (self.total_input_tokens + self.total_output_tokens) / self.duration_s

    def latency(self, key: str) -> ItlStats | None:
        """One distribution by vLLM's key: ttft, tpot, itl or e2el."""
        return getattr(self, key)


def summarize(setup: BenchSetup, run: LoadRun) -> ServeBenchResult:
    """Add up the outcomes of `run`."""
    done = [o for o in run.outcomes if o.ok and o.metrics is not None]
    failures = [o.error for o in run.outcomes if not o.ok]
    return ServeBenchResult(
        setup=setup,
        duration_s=run.duration_s,
        completed=len(done),
        failed=len(failures),
        first_error=failures[0] if failures else None,
        total_input_tokens=sum(o.input_tokens for o in done),
        total_output_tokens=sum(o.output_tokens for o in done),
        ttft=itl_stats([o.metrics.ttft_ms for o in done]),
        tpot=itl_stats([o.metrics.tpot_ms for o in done if o.metrics.tpot_ms is not None]),
        itl=itl_stats([gap for o in done for gap in o.gaps_ms]),
        e2el=itl_stats([o.metrics.e2e_ms for o in done]),
        outcomes=run.outcomes,
        answers=tally_answers(run.outcomes, setup.structured) if setup.structured is not None else None,
    )


def summary_block(result: ServeBenchResult) -> str:
    """vLLM's "Serving Benchmark Result" block, in its words and order, with the first error when any failed."""
    setup = result.setup
    lines = [" Serving Benchmark Result ".center(_WIDTH, "="), _row("Successful requests:", result.completed)]
    lines.append(_row("Failed requests:", result.failed))
    if result.first_error is not None:
        lines.append(f"First error: {result.first_error}")
    if result.answers is not None:  # not in vLLM's block: its client checks no answer
        lines += _answer_rows(result.answers)
    if setup.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", setup.max_concurrency))
    if setup.every_chunk:  # not in vLLM's block: its client always times this way
        lines.append(_row("Timed chunks:", "every chunk with a choice"))
    if setup.structured is not None:
        lines.append(_row("Response format:", setup.structured.describe()))
    if not math.isinf(setup.request_rate):
        lines.append(_row("Request rate configured (RPS):", f"{setup.request_rate:.2f}"))
    lines += [
        _row("Benchmark duration (s):", f"{result.duration_s:.2f}"),
        _row("Total input tokens:", result.total_input_tokens),
        _row("Total generated tokens:", result.total_output_tokens),
        _row("Request throughput (req/s):", f"{result.request_throughput:.2f}"),
        _row("Output token throughput (tok/s):", f"{result.output_throughput:.2f}"),
        _row("Total Token throughput (tok/s):", f"{result.total_token_throughput:.2f}"),
    ]
    for key, name, header in _LATENCIES:
        stats = result.latency(key)
        lines.append(header.center(_WIDTH, "-"))
        for label, value in (("Mean", "mean"), ("Median", "median"), ("P99", "p99")):
            lines.append(_row(f"{label} {name} (ms):", "n/a" if stats is None else f"{getattr(stats, value):.2f}"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def result_dict(result: ServeBenchResult) -> dict:
    """The result file: vLLM's keys for the figures, then each request's own (in ms, in prompt order)."""
    setup = result.setup
    out: dict = {
        "backend": "openai-chat" if setup.endpoint.endswith("/chat/completions") else "openai",
        "base_url": setup.base_url,
        "endpoint": setup.endpoint,
        "model_id": setup.model,
        "tokenizer_id": setup.tokenizer,
        "num_prompts": setup.num_prompts,
        "random_input_len": setup.input_len,
        "random_output_len": setup.output_len,
        "output_lens_from": setup.output_lens_from,
        "request_rate": "inf" if math.isinf(setup.request_rate) else setup.request_rate,
        "burstiness": setup.burstiness,
        "max_concurrency": setup.max_concurrency,
        "seed": setup.seed,
        "timed_chunks": "every" if setup.every_chunk else "visible text",
        "duration": result.duration_s,
        "completed": result.completed,
        "failed": result.failed,
        "first_error": result.first_error,
        "total_input_tokens": result.total_input_tokens,
        "total_output_tokens": result.total_output_tokens,
        "request_throughput": result.request_throughput,
        "output_throughput": result.output_throughput,
        "total_token_throughput": result.total_token_throughput,
    }
    for key, _name, _header in _LATENCIES:
        stats = result.latency(key)
        for figure in ("mean", "median", "std", "p99"):
            out[f"{figure}_{key}_ms"] = None if stats is None else getattr(stats, figure)
    out["input_lens"] = [o.input_tokens for o in result.outcomes]
    out["output_lens"] = [o.output_tokens if o.ok else 0 for o in result.outcomes]
    out["ttfts_ms"] = [o.metrics.ttft_ms if o.metrics else None for o in result.outcomes]
    out["e2els_ms"] = [o.metrics.e2e_ms if o.metrics else None for o in result.outcomes]
    out["itls_ms"] = [list(o.gaps_ms) for o in result.outcomes]
    out["errors"] = [o.error or "" for o in result.outcomes]
    if result.answers is not None:
        out.update(_answer_fields(setup.structured, result.answers, result.outcomes))
    return out


def _answer_rows(answers: AnswerTally) -> list[str]:
    share = "n/a" if answers.share is None else f"({answers.share:.1%})"
    rows = [_row("Valid answers:", f"{answers.valid} / {answers.validated} {share}")]
    rows.append(_row("Cut by length:", answers.cut_by_length))
    if answers.first_problem is not None:
        rows.append(f"First invalid answer: {answers.first_problem}")
    return rows


def _answer_fields(structured: StructuredOutput, answers: AnswerTally, outcomes: tuple[RequestOutcome, ...]) -> dict:
    """The checks in the result file: the counts, then each request's verdict and text (in prompt order)."""
    return {
        "response_format": structured.kind,
        "json_schema_name": structured.name or None,
        "valid_answers": answers.valid,
        "validated_answers": answers.validated,
        "valid_share": answers.share,
        "cut_by_length": answers.cut_by_length,
        "first_invalid_answer": answers.first_problem,
        "answer_verdicts": [c.verdict if c is not None else "" for c in answers.checks],
        "answer_problems": [c.problem if c is not None else "" for c in answers.checks],
        "generated_texts": [o.text or "" for o in outcomes],
        "finish_reasons": [o.finish_reason or "" for o in outcomes],
    }


def _row(label: str, value: object) -> str:
    return f"{label:<40} {value!s:<10}".rstrip()
