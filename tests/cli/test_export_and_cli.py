"""`reqscope --plain/--json/--export` end to end, and the exported files read back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minengine.engine.events import DoneEvent, TokenEvent
from minengine.record.trace_io import read_trace
from reqscope.cli import main


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_mode_lines(chatty_tiny_dir, capsys):
    code, out, _ = _run(
        ["--json", "--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "5", "hi"], capsys
    )
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    stages = [r["name"] for r in records if r["event"] == "stage"]
    assert stages == ["gateway", "template", "tokenize", "admit", "prefill", "decode", "complete"]
    tokens = [r for r in records if r["event"] == "token"]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert all(t["kv_physical_bytes"] >= t["kv_logical_bytes"] > 0 for t in tokens)
    done = records[-1]
    assert done["event"] == "done"
    assert done["usage"]["completion_tokens"] == len(tokens)
    assert set(done["metrics"]) >= {"ttft_ms", "e2e_ms", "tpot_ms", "itl_ms"}


def test_plain_mode_and_export_round_trip(chatty_tiny_dir, tmp_path, capsys):
    export = tmp_path / "run"
    code, out, err = _run(
        [
            "--plain",
            "--model",
            str(chatty_tiny_dir),
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--export",
            str(export),
            "Tell me about Kyoto",
        ],
        capsys,
    )
    assert code == 0
    for needle in ("prefill", "decode", "TTFT", "TPOT", "ITL", "E2E", "KV", "unaccounted"):
        assert needle in err
    metrics = json.loads((export / "request-metrics.json").read_text())
    # The exported timeline recomputes the same metrics through the seed's calculator.
    code, calc_out, _ = _run(
        ["metrics", str(export / "request-timeline.csv"), "--output-tokens", str(metrics["output_tokens"])], capsys
    )
    assert code == 0
    calc = json.loads(calc_out)
    # The CSV keeps times to 3 decimals (ms), so a span between two of them is off by up to
    # 0.001 ms: the decode rate, (O - 1) / (E2E - TTFT), by up to 0.001 / (E2E - TTFT) relative,
    # which on a fast tiny model is more than a fixed 1e-4.
    decode_span_ms = metrics["e2e_ms"] - metrics["ttft_ms"]
    rate_rel = 1e-4 if decode_span_ms <= 0 else max(1e-4, 1.01e-3 / decode_span_ms)
    for key in ("ttft_ms", "e2e_ms", "tpot_ms", "decode_output_tokens_per_second"):
        if metrics[key] is not None:
            rel = rate_rel if key == "decode_output_tokens_per_second" else 1e-4
            assert calc[key] == pytest.approx(metrics[key], rel=rel, abs=2e-3), key
    perfetto = json.loads((export / "request-trace.perfetto.json").read_text())
    spans = [e["name"] for e in perfetto["traceEvents"] if e.get("ph") == "X"]
    assert spans[:5] == ["gateway", "template", "tokenize", "admit", "prefill"]
    telemetry = json.loads((export / "request-telemetry.json").read_text())
    assert telemetry["finish_reason"] in ("length", "stop") and telemetry["cancelled"] is False
    header, events = read_trace(export / "request-trace.jsonl")
    assert header.layers == 2
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert tokens and tokens[0].trace is not None and len(tokens[0].trace.candidates) == 20
    assert isinstance(events[-1], DoneEvent) and events[-1].result.usage.completion_tokens == len(tokens)
    assert "".join(t.text for t in tokens) in out


@pytest.mark.parametrize(
    ("argv", "needle", "code"),
    [
        (["--plain", "--temperature", "-1", "x"], "temperature", 1),
        (["--plain", "--top-p", "0", "x"], "top_p", 1),
        (["--plain", "--max-tokens", "0", "x"], "max_tokens", 1),
        (["--plain", "--sampler-order", "top_k,bogus", "x"], "bogus", 1),
        (["--plain", "--kv-budget-mib", "0.01", "x"], "MiB of KV, budget 0.0 MiB", 1),
        (["--plain", "--kv-layout", "paged", "x"], "invalid choice", 2),
    ],
)
def test_bad_input_is_one_line_with_exit_code(chatty_tiny_dir, capsys, argv, needle, code):
    with pytest.raises(SystemExit) if code == 2 else _nothing():
        got, _, err = _run(argv[:1] + ["--model", str(chatty_tiny_dir)] + argv[1:], capsys)
        assert got == code
        assert needle in err
        assert "Traceback" not in err


def test_missing_model_folder_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "reqscope", "--plain", "--model", str(tmp_path / "nope"), "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("reqscope: error: model folder")
    assert "Traceback" not in proc.stderr


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
