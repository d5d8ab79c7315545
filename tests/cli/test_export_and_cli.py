"""`reqscope --plain/--json/--export` end to end, and the exported files read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert stages == ["gateway", "template", "tokenize", "admit", "prefix_cache", "prefill", "decode", "complete"]
    tokens = [r for r in records if r["event"] == "token"]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert all(t["kv_physical_bytes"] >= t["kv_logical_bytes"] > 0 for t in tokens)
    done = records[-1]
    assert done["event"] == "done"
    assert done["usage"]["completion_tokens"] == len(tokens)
    assert set(done["metrics"]) >= {"ttft_ms", "e2e_ms", "tpot_ms", "itl_ms"}
    assert list(done["metrics"]["itl_ms"]) == ["mean", "median", "std", "p90", "p95", "p99", "max"]


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
        ["metrics", str(export / "request-timeline.csv"), "--output-len", str(metrics["output_tokens"])], capsys
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
    # The export and --json share one ITL summary: mean, median, std, p90, p95, p99, max.
    assert list(metrics["itl_ms"]) == ["mean", "median", "std", "p90", "p95", "p99", "max"]
    perfetto = json.loads((export / "request-trace.perfetto.json").read_text())
    spans = [e["name"] for e in perfetto["traceEvents"] if e.get("ph") == "X"]
    assert spans[:6] == ["gateway", "template", "tokenize", "admit", "prefix_cache", "prefill"]
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


@pytest.mark.parametrize(
    "argv",
    [
        ["--plain", "--max-tokens", "4", "hi"],
        ["--json", "--max-tokens", "4", "hi"],
        ["metrics", "DATA/request-timeline.csv", "--output-len", "150"],
    ],
    ids=["plain", "json", "metrics"],
)
def test_a_reader_that_leaves_ends_the_command_quietly(chatty_tiny_dir, argv):
    # `reqscope ... | head -c 0`: the pipe's read end is closed before the first write.
    data = Path(__file__).resolve().parent.parent / "data"
    argv = [a.replace("DATA", str(data)) for a in argv]
    if argv[0] != "metrics":
        argv = ["--model", str(chatty_tiny_dir), *argv]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "reqscope", *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write_end)
    assert proc.returncode in (0, 141), proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def _export_run(chatty_tiny_dir, folder, capsys, *extra):
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "3"]
    return _run([*argv, "--export", str(folder), *extra, "Tell me about Kyoto"], capsys)


def test_a_second_export_into_the_same_folder_is_refused_and_writes_nothing(chatty_tiny_dir, tmp_path, capsys):
    folder = tmp_path / "run"
    assert _export_run(chatty_tiny_dir, folder, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    code, out, err = _export_run(chatty_tiny_dir, folder, capsys)
    assert code == 1 and out == ""  # refused before the request ran: no answer streamed
    assert "already holds files" in err and "--force" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_force_replaces_the_earlier_runs_files_and_leaves_none_of_them(chatty_tiny_dir, tmp_path, capsys):
    from minengine.record.export import EXPORT_FILES

    folder = tmp_path / "run"
    folder.mkdir()
    for name in EXPORT_FILES:  # an earlier run's files, and one file of the user's own
        (folder / name).write_text("earlier run")
    (folder / "notes.txt").write_text("mine")
    code, _, err = _export_run(chatty_tiny_dir, folder, capsys, "--force")
    assert code == 0, err
    assert (folder / "notes.txt").read_text() == "mine"
    # Every earlier export file is gone or rewritten by this run (a run with no visible token
    # writes no CSV, and the earlier one must not stay behind either).
    for name in EXPORT_FILES:
        path = folder / name
        assert not path.exists() or path.read_text() != "earlier run", name


@pytest.mark.parametrize("kind", ["a-file", "unwritable"])
def test_a_bad_export_path_fails_before_the_run(chatty_tiny_dir, tmp_path, capsys, kind):
    if kind == "a-file":
        target = tmp_path / "file.txt"
        target.write_text("x")
        needle = "is a file"
    else:
        if os.geteuid() == 0:
            target, needle = Path("/proc/reqscope-export"), "cannot write"
        else:
            locked = tmp_path / "locked"
            locked.mkdir(mode=0o500)
            target, needle = locked / "run", "cannot write"
    code, out, err = _export_run(chatty_tiny_dir, target, capsys)
    assert code == 1 and out == "" and needle in err and "Traceback" not in err


def test_ctrl_c_while_a_verb_loads_is_one_line_and_130(monkeypatch, capsys):
    from reqscope import cli

    def interrupted_import(verb):
        raise KeyboardInterrupt  # what SIGINT does in the middle of `import torch`

    monkeypatch.setattr(cli, "build_parser", interrupted_import)
    assert cli.main(["--plain", "hi"]) == 130
    assert capsys.readouterr().err == "reqscope: interrupted\n"


def test_export_with_the_explorer_is_refused_not_dropped(monkeypatch, capsys, tmp_path):
    import reqscope.commands.run as run_command

    monkeypatch.setattr(run_command.sys.stdout, "isatty", lambda: True)  # as on a terminal
    assert main(["--export", str(tmp_path / "x"), "hi"]) == 2
    assert "--export works with --plain or --json; in the explorer press x" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
