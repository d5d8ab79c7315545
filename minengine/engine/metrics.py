"""Per-request and per-window latency metrics, as pure arithmetic on timestamps and counts.

Symbols used throughout (all times in milliseconds on one clock):

* s: the client sends the request;
* f: the first non-empty visible output arrives;
* e: the last visible output arrives;
* O: visible output tokens.

    TTFT = f - s
    E2E  = e - s
    TPOT = (E2E - TTFT) / (O - 1)              only for O > 1
    decode-only output rate   = (O - 1) / (E2E - TTFT)
    whole-request output rate = O / E2E

Token 1 closes TTFT, so only O - 1 transitions follow it. Charging O gaps to the decode phase,
or dividing all O tokens by the decode duration, are the two classic off-by-one mistakes;
neither appears here.

ITL is different from TPOT: it is every individual gap between consecutive streamed events.
When each event carries exactly one token, TPOT equals the arithmetic mean of the ITLs; when
events carry several tokens (speculative decoding, server-side batching of SSE chunks) they
diverge, and both are reported.

A run that is paused or stepped (the explorer) holds the engine between tokens; those gaps then
hold the person's time, not the engine's. `without_held` takes it out of the event times, and
the same formulas over what is left give the engine's own figures; the wall-clock figures stay
what a client would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from minengine.errors import RequestError

# Tolerance when checking that the per-event times agree with the first/last timestamps; the
# same clock reading can round differently after a trip through CSV or JSON.
_SAME_TIME_TOLERANCE_MS = 1e-6


class MetricsInputError(RequestError, ValueError):
    """Timestamps, token counts or request counts that cannot describe a real request."""


@dataclass(frozen=True)
class ItlStats:
    """Summary of inter-token gaps, all in milliseconds except `count`.

    Percentiles use linear interpolation between the two nearest ranks, the same rule as
    numpy.percentile's default ("linear"): rank = p/100 x (n - 1) on the sorted gaps.
    """

    count: int
    mean: float
    median: float
    p90: float
    p95: float
    p99: float
    max: float
    # Population standard deviation (numpy's default, as vLLM's benchmark reports it); None in
    # traces recorded before it was kept.
    std: float | None = None

    def summary(self) -> dict[str, float | None]:
        """The ITL summary every output shares (--json, --export, the server's report)."""
        return {
            "mean": self.mean,
            "median": self.median,
            "std": self.std,
            "p90": self.p90,
            "p95": self.p95,
            "p99": self.p99,
            "max": self.max,
        }


@dataclass(frozen=True)
class RequestMetrics:
    """Client-observed metrics of one request; rates are in output tokens per second."""

    ttft_ms: float
    e2e_ms: float
    tpot_ms: float | None
    decode_output_tokens_per_second: float | None
    whole_request_output_tokens_per_second: float | None
    itl: ItlStats | None
    output_tokens: int

    @property
    def decode_ms(self) -> float:
        """Time from the first to the last visible output (E2E - TTFT)."""
        return self.e2e_ms - self.ttft_ms


@dataclass(frozen=True)
class SystemWindow:
    """Request counts observed in one closed measurement window.

    `successful` requests finished without error; `slo_passing` is the subset of them that met
    the latency objectives. Counts must nest: 0 <= slo_passing <= successful <= attempted.
    """

    window_seconds: float
    attempted: int
    successful: int
    slo_passing: int

    def __post_init__(self) -> None:
        for name in ("attempted", "successful", "slo_passing"):
            _require_count(name, getattr(self, name))
        if not (math.isfinite(self.window_seconds) and self.window_seconds > 0):
            raise MetricsInputError(
                f"window_seconds must be a positive number, got {self.window_seconds}"
            )
        if self.attempted == 0:
            raise MetricsInputError("attempted is 0: an error rate needs at least one request")
        if not (0 <= self.slo_passing <= self.successful <= self.attempted):
            raise MetricsInputError(
                "request counts must nest as slo_passing <= successful <= attempted, got "
                f"{self.slo_passing} <= {self.successful} <= {self.attempted}"
            )

    @property
    def request_throughput_rps(self) -> float:
        """Successful requests per second of window."""
        return self.successful / self.window_seconds

    @property
    def observed_goodput_rps(self) -> float:
        """Requests per second that both succeeded and met their SLOs."""
        return self.slo_passing / self.window_seconds

    @property
    def error_rate(self) -> float:
        """Fraction of attempted requests that failed."""
        return (self.attempted - self.successful) / self.attempted


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of already sorted values, by linear interpolation."""
    if not sorted_values:
        raise MetricsInputError("percentile of an empty sequence is undefined")
    if not 0 <= p <= 100:
        raise MetricsInputError(f"percentile must be within 0..100, got {p}")
    rank = p / 100 * (len(sorted_values) - 1)
    lower = math.floor(rank)
    upper = min(lower + 1, len(sorted_values) - 1)
    below, above = sorted_values[lower], sorted_values[upper]
    return below + (rank - lower) * (above - below)


def itl_stats(gaps_ms: Sequence[float]) -> ItlStats | None:
    """Summarise inter-token gaps; None when there are none (a single streamed event)."""
    if not gaps_ms:
        return None
    for gap in gaps_ms:
        if not math.isfinite(gap) or gap < 0:
            raise MetricsInputError(f"inter-token gaps must be finite and >= 0, got {gap}")
    ordered = sorted(gaps_ms)
    mean = math.fsum(ordered) / len(ordered)
    return ItlStats(
        count=len(ordered),
        mean=mean,
        std=math.sqrt(math.fsum((gap - mean) ** 2 for gap in ordered) / len(ordered)),
        median=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p95=percentile(ordered, 95),
        p99=percentile(ordered, 99),
        max=ordered[-1],
    )


def inter_token_gaps(event_times_ms: Sequence[float]) -> tuple[float, ...]:
    """Gaps between consecutive streamed events, which must be in time order."""
    for earlier, later in zip(event_times_ms, event_times_ms[1:], strict=False):
        if later < earlier:
            raise MetricsInputError(
                f"streamed event times go backwards ({earlier} ms then {later} ms)"
            )
    return tuple(b - a for a, b in zip(event_times_ms, event_times_ms[1:], strict=False))


def without_held(times_ms: Sequence[float], held_before_ms: Sequence[float]) -> tuple[float, ...]:
    """Event times on the engine's own clock: each time minus the time held before it.

    `held_before_ms[i]` is the total time, up to event i, that the request's consumer kept the
    engine waiting (a paused or stepped run). What is left is the time the engine itself took,
    to which the same formulas apply; with nothing held the times come back unchanged.
    """
    if len(times_ms) != len(held_before_ms):
        raise MetricsInputError(f"{len(times_ms)} event times but {len(held_before_ms)} held totals")
    for earlier, later in zip(held_before_ms, held_before_ms[1:], strict=False):
        if later < earlier:
            raise MetricsInputError(f"held time cannot shrink ({earlier} ms then {later} ms)")
    return tuple(t - held for t, held in zip(times_ms, held_before_ms, strict=True))


def request_latency(send_ms: float, first_ms: float, last_ms: float) -> tuple[float, float]:
    """(TTFT, E2E) in ms after checking that s <= f <= e on one clock."""
    for name, value in (("send", send_ms), ("first token", first_ms), ("last token", last_ms)):
        if not math.isfinite(value):
            raise MetricsInputError(f"{name} time must be a finite number, got {value}")
    if not send_ms <= first_ms <= last_ms:
        raise MetricsInputError(
            "timestamps must satisfy send <= first token <= last token, got "
            f"{send_ms} / {first_ms} / {last_ms} ms"
        )
    return first_ms - send_ms, last_ms - send_ms


def request_metrics(
    send_ms: float,
    first_ms: float,
    last_ms: float,
    output_tokens: int,
    token_times_ms: Sequence[float] | None = None,
) -> RequestMetrics:
    """Metrics of one request from its send, first-token and last-token times.

    `token_times_ms`, when given, are the arrival times of every streamed event (first to last,
    one or more tokens each); they add the ITL distribution and must start at `first_ms`, end
    at `last_ms` and number at most `output_tokens`.
    """
    _require_count("output_tokens", output_tokens)
    if output_tokens < 1:
        raise MetricsInputError("output_tokens must be >= 1: a first token was observed")
    ttft, e2e = request_latency(send_ms, first_ms, last_ms)
    decode_ms = e2e - ttft
    if output_tokens == 1 and decode_ms != 0:
        raise MetricsInputError(
            f"one output token, yet the last token arrives {decode_ms} ms after the first; "
            "with a single token the first and last visible token are the same event"
        )
    if output_tokens > 1 and decode_ms <= 0:
        raise MetricsInputError(
            f"{output_tokens} output tokens need a positive time between the first and last "
            "token, got 0 ms"
        )
    itl = None
    if token_times_ms is not None:
        itl = itl_stats(_checked_event_gaps(token_times_ms, first_ms, last_ms, output_tokens))

    tpot = decode_rate = None
    if output_tokens > 1:
        tpot = decode_ms / (output_tokens - 1)
        decode_rate = (output_tokens - 1) * 1000 / decode_ms
    whole_rate = output_tokens * 1000 / e2e if e2e > 0 else None
    return RequestMetrics(
        ttft_ms=ttft,
        e2e_ms=e2e,
        tpot_ms=tpot,
        decode_output_tokens_per_second=decode_rate,
        whole_request_output_tokens_per_second=whole_rate,
        itl=itl,
        output_tokens=output_tokens,
    )


def _checked_event_gaps(
    times: Sequence[float], first_ms: float, last_ms: float, output_tokens: int
) -> tuple[float, ...]:
    if not times:
        raise MetricsInputError("token_times_ms is empty; pass None when there are no events")
    if len(times) > output_tokens:
        raise MetricsInputError(
            f"{len(times)} streamed events cannot carry only {output_tokens} output tokens"
        )
    if not math.isclose(times[0], first_ms, abs_tol=_SAME_TIME_TOLERANCE_MS):
        raise MetricsInputError(f"first event at {times[0]} ms, but first token at {first_ms} ms")
    if not math.isclose(times[-1], last_ms, abs_tol=_SAME_TIME_TOLERANCE_MS):
        raise MetricsInputError(f"last event at {times[-1]} ms, but last token at {last_ms} ms")
    return inter_token_gaps(times)


def _require_count(name: str, value: object) -> None:
    # bool is an int subclass; True as a request count is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MetricsInputError(f"{name} must be a whole number, got {value!r}")
    if value < 0:
        raise MetricsInputError(f"{name} must be >= 0, got {value}")
