"""Request/window metrics and the `reqscope metrics` calculator, against the seeds' numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minengine.engine.metrics import (
    MetricsInputError,
    SystemWindow,
    inter_token_gaps,
    itl_stats,
    percentile,
    request_metrics,
)
from minengine.errors import RequestError
from reqscope.cli import main

DATA = Path(__file__).parent.parent / "data"
WORKED_EXAMPLE = DATA / "request-timeline.csv"  # 150 tokens, first at 190 ms, last at 3915 ms
EXERCISE = DATA / "request-timeline-alt.csv"  # 256 tokens, first at 420 ms, 255 gaps of 18 ms

WORKED_ARGS = [
    "metrics",
    str(WORKED_EXAMPLE),
    "--output-len", "150",
    "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--kv-bytes", "2",
    "--input-len", "1025",
    "--window-seconds", "10", "--attempted", "100", "--successful", "98", "--slo-passing", "95",
]  # fmt: skip


def _cli_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI expecting exit code 2; return its single stderr line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse rejects unparsable flags itself
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    return lines[0]


# --- per-request formulas -----------------------------------------------------------------


def test_worked_example_request_metrics():
    m = request_metrics(0, 190, 190 + 149 * 25, 150)
    assert m.ttft_ms == 190
    assert m.e2e_ms == 3915
    assert m.tpot_ms == 25
    assert m.decode_output_tokens_per_second == pytest.approx(40.0)
    assert m.whole_request_output_tokens_per_second == pytest.approx(38.314176, abs=1e-6)
    assert round(m.whole_request_output_tokens_per_second, 2) == 38.31


def test_worked_example_off_by_one_variants_are_not_what_we_compute():
    m = request_metrics(0, 190, 3915, 150)
    # 150 gaps would put the last token at 3940 ms; 150 tokens / decode time would be 40.27/s.
    assert m.e2e_ms != 190 + 150 * 25
    assert m.decode_output_tokens_per_second != pytest.approx(150 / 3.725)


def test_exercise_request_metrics():
    m = request_metrics(0, 420, 420 + 255 * 18, 256)
    assert m.e2e_ms == 5010
    assert m.tpot_ms == 18
    assert round(m.decode_output_tokens_per_second, 2) == 55.56
    assert round(m.whole_request_output_tokens_per_second, 2) == 51.10


def test_uniform_token_times_give_itl_stats_equal_to_tpot():
    times = [190 + 25 * i for i in range(150)]
    m = request_metrics(0, times[0], times[-1], 150, times)
    assert m.itl is not None
    assert m.itl.count == 149
    assert (m.itl.mean, m.itl.median, m.itl.p99, m.itl.max) == (25, 25, 25, 25)


def test_single_token_request_has_no_tpot_but_a_whole_request_rate():
    m = request_metrics(10, 110, 110, 1, [110])
    assert m.ttft_ms == m.e2e_ms == 100
    assert m.tpot_ms is None and m.decode_output_tokens_per_second is None
    assert m.whole_request_output_tokens_per_second == pytest.approx(10.0)
    assert m.itl is None


def test_multi_token_chunks_separate_itl_from_tpot():
    # Speculative decoding: 4 events carrying 10 tokens, so per-chunk gaps exceed TPOT.
    times = [100.0, 130.0, 160.0, 190.0]
    m = request_metrics(0, 100, 190, 10, times)
    assert m.tpot_ms == pytest.approx(10.0)
    assert m.itl is not None and m.itl.mean == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((0, 200, 100, 5), "send <= first token <= last token"),
        ((50, 10, 100, 5), "send <= first token <= last token"),
        ((0, 10, 100, 0), "output_tokens must be >= 1"),
        ((0, 10, 100, -3), "output_tokens must be >= 0"),
        ((0, 10, 100, 2.5), "whole number"),
        ((0, 10, 10, 5), "positive time between"),
        ((0, 10, 20, 1), "single token"),
        ((0, float("nan"), 20, 2), "finite"),
    ],
)
def test_impossible_requests_are_rejected(args, fragment):
    with pytest.raises(MetricsInputError, match=fragment) as info:
        request_metrics(*args)
    assert isinstance(info.value, RequestError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("times", "fragment"),
    [
        ([], "empty"),
        ([10, 50, 40, 100], "backwards"),
        ([11, 50, 100], "first event"),
        ([10, 50, 99], "last event"),
        ([10, 20, 30, 40, 50, 100], "cannot carry"),
    ],
)
def test_token_times_must_agree_with_the_endpoints(times, fragment):
    with pytest.raises(MetricsInputError, match=fragment):
        request_metrics(0, 10, 100, 5, times)


# --- ITL statistics ---------------------------------------------------------------------


def test_itl_stats_match_numpy_linear_percentiles():
    gaps = [12.0, 30.0, 18.0, 25.0, 90.0, 21.0, 19.5]
    stats = itl_stats(gaps)
    assert stats is not None
    assert stats.count == 7
    assert stats.mean == pytest.approx(np.mean(gaps))
    assert stats.median == pytest.approx(21.0)
    for p, value in ((90, stats.p90), (95, stats.p95), (99, stats.p99)):
        assert value == pytest.approx(np.percentile(gaps, p))
    assert stats.p90 == pytest.approx(30.0 + 0.4 * (90.0 - 30.0))  # rank 5.4 of 0..6
    assert stats.max == 90.0
    assert stats.std == pytest.approx(np.std(gaps))  # population std, as vLLM's benchmark reports
    assert list(stats.summary()) == ["mean", "median", "std", "p90", "p95", "p99", "max"]


def test_itl_stats_empty_and_invalid():
    assert itl_stats([]) is None
    with pytest.raises(MetricsInputError):
        itl_stats([5.0, -1.0])
    with pytest.raises(MetricsInputError):
        percentile([1.0], 101)


@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=60), st.floats(0, 100))
def test_percentile_agrees_with_numpy(values, p):
    ordered = sorted(values)
    assert percentile(ordered, p) == pytest.approx(np.percentile(ordered, p), abs=1e-6)


# --- properties over arbitrary valid timelines -------------------------------------------

timelines = st.tuples(
    st.floats(-1e6, 1e6),  # send time; any clock origin
    st.floats(0, 1e5),  # TTFT
    st.lists(st.floats(0.001, 1e3), min_size=1, max_size=300),  # ITLs, one token per event
)


@given(timelines)
def test_one_token_per_event_properties(timeline):
    send, ttft, gaps = timeline
    times = [send + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    # Rebuild the gaps from the rounded absolute times, which is what a client would observe.
    observed = inter_token_gaps(times)
    m = request_metrics(send, times[0], times[-1], len(times), times)
    assert m.e2e_ms >= m.ttft_ms >= 0
    assert m.itl is not None and m.itl.count == len(times) - 1
    assert m.tpot_ms == pytest.approx(math.fsum(observed) / len(observed), rel=1e-9, abs=1e-6)
    assert m.tpot_ms == pytest.approx(m.itl.mean, rel=1e-9, abs=1e-6)
    assert m.decode_output_tokens_per_second == pytest.approx(1000 / m.tpot_ms, rel=1e-9)
    assert m.itl.median <= m.itl.p90 <= m.itl.p95 <= m.itl.p99 <= m.itl.max
    # The whole-request rate trails the decode-only rate exactly when TTFT exceeds TPOT.
    whole, decode = m.whole_request_output_tokens_per_second, m.decode_output_tokens_per_second
    if m.ttft_ms > m.tpot_ms * (1 + 1e-6):
        assert whole < decode
    elif m.ttft_ms < m.tpot_ms * (1 - 1e-6):
        assert whole > decode
    # Whole-request rate is O / E2E by definition, whatever the split.
    assert m.whole_request_output_tokens_per_second == pytest.approx(
        len(times) / (m.e2e_ms / 1000), rel=1e-9
    )


@given(st.floats(0, 1e4), st.floats(0.01, 1e3), st.integers(2, 5000))
def test_uniform_gaps_reconstruct_e2e(ttft, itl, output_tokens):
    m = request_metrics(0, ttft, ttft + (output_tokens - 1) * itl, output_tokens)
    assert m.tpot_ms == pytest.approx(itl, rel=1e-9)
    assert m.e2e_ms == pytest.approx(m.ttft_ms + (output_tokens - 1) * m.tpot_ms, rel=1e-9)


# --- system window -----------------------------------------------------------------------


def test_seed_system_window():
    window = SystemWindow(window_seconds=10, attempted=100, successful=98, slo_passing=95)
    assert window.request_throughput_rps == pytest.approx(9.8)
    assert window.observed_goodput_rps == pytest.approx(9.5)
    assert window.error_rate == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"slo_passing": 99}, "nest"),
        ({"successful": 101, "slo_passing": 95}, "nest"),
        ({"window_seconds": 0}, "window_seconds"),
        ({"window_seconds": float("inf")}, "window_seconds"),
        ({"attempted": 0, "successful": 0, "slo_passing": 0}, "attempted is 0"),
        ({"attempted": -1}, ">= 0"),
        ({"successful": True}, "whole number"),
    ],
)
def test_inconsistent_windows_are_rejected(kwargs, fragment):
    base = {"window_seconds": 10, "attempted": 100, "successful": 98, "slo_passing": 95}
    with pytest.raises(MetricsInputError, match=fragment):
        SystemWindow(**{**base, **kwargs})


# --- the CLI calculator ------------------------------------------------------------------


def test_cli_reproduces_worked_example(capsys):
    out = _cli_json(WORKED_ARGS, capsys)
    assert out["kv_bytes_per_token"] == 327680
    assert out["prompt_kv_mib"] == 320.3125
    assert out["stop_kv_mib"] == 366.875
    assert (out["ttft_ms"], out["e2e_ms"], out["tpot_ms"]) == (190, 3915, 25)
    assert out["decode_output_tokens_per_second"] == pytest.approx(40.0)
    assert out["whole_request_output_tokens_per_second"] == pytest.approx(150 / 3.915)
    assert out["request_throughput_rps"] == pytest.approx(9.8)
    assert out["observed_goodput_rps"] == pytest.approx(9.5)
    assert out["error_rate"] == pytest.approx(0.02)
    assert "logical" in out["scope"] and "unsharded" in out["scope"]


def test_cli_reproduces_exercise(capsys):
    argv = [
        "metrics", str(EXERCISE), "--output-len", "256",
        "--layers", "48", "--kv-heads", "4", "--head-dim", "128", "--kv-bytes", "1",
        "--input-len", "4096",
    ]  # fmt: skip
    out = _cli_json(argv, capsys)
    assert out["kv_bytes_per_token"] == 49152
    assert out["kv_bytes_per_token"] / 2**20 == 0.046875
    assert out["prompt_kv_mib"] == 192
    assert out["prompt_kv_mib"] / 1024 == 0.1875
    assert out["ttft_ms"] == 420 and out["e2e_ms"] == 5010
    assert round(out["decode_output_tokens_per_second"], 2) == 55.56
    assert round(out["whole_request_output_tokens_per_second"], 2) == 51.10
    assert "request_throughput_rps" not in out  # no window inputs, no window figures


def test_cli_leaves_out_parts_without_inputs(capsys):
    out = _cli_json(["metrics", str(WORKED_EXAMPLE)], capsys)
    assert set(out) == {"scope", "ttft_ms", "e2e_ms"}
    out = _cli_json(["metrics", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
                     "--kv-bytes", "2"], capsys)  # fmt: skip
    assert set(out) == {"scope", "kv_bytes_per_token"}


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "timeline.csv"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("csv_text", "fragment"),
    [
        (
            "event,time_ms,detail\nclient_send,0,\nclient_send,1,\nfirst_visible_token,5,\n"
            "last_visible_token,9,\n",
            "more than once",
        ),
        ("event,time_ms,detail\nclient_send,0,\nlast_visible_token,9,\n", "first_visible_token"),
        (
            "event,time_ms,detail\nclient_send,0,\nfirst_visible_token,50,\n"
            "last_visible_token,20,\n",
            "out of order",
        ),
        (
            "event,time_ms,detail\nclient_send,zero,\nfirst_visible_token,5,\n"
            "last_visible_token,9,\n",
            "not a number",
        ),
    ],
)
def test_cli_broken_timelines_exit_2(tmp_path, capsys, csv_text, fragment):
    line = _cli_error(["metrics", _write(tmp_path, csv_text), "--output-len", "5"], capsys)
    assert fragment in line and line.startswith("reqscope: error:")


@pytest.mark.parametrize(
    ("replace", "fragment"),
    [
        ({"--slo-passing": "99"}, "nest"),
        ({"--successful": "101"}, "nest"),
        ({"--window-seconds": "0"}, "greater than 0"),
        ({"--attempted": "0", "--successful": "0", "--slo-passing": "0"}, "attempted is 0"),
        ({"--attempted": "lots"}, "not a whole number"),
        ({"--output-len": "-5"}, "negative"),
        ({"--output-len": "0"}, ">= 1"),
        ({"--kv-bytes": "two"}, "not a number"),
    ],
)
def test_cli_bad_numbers_exit_2(capsys, replace, fragment):
    argv = list(WORKED_ARGS)
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = value
    assert fragment in _cli_error(argv, capsys)


def test_cli_missing_file_and_partial_groups_exit_2(tmp_path, capsys):
    assert "no timeline file" in _cli_error(["metrics", str(tmp_path / "nope.csv")], capsys)
    line = _cli_error(["metrics", "--layers", "80", "--kv-heads", "8"], capsys)
    assert "--head-dim" in line and "--kv-bytes" in line
    assert "nothing to compute" in _cli_error(["metrics"], capsys)
