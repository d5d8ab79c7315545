"""The rooflines in the console: --json token and done keys (decode's memory roofline, prefill's compute
roofline), --plain lines, the trace, `calibrate --ceiling-only`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from minengine.config import ModelConfig
from minengine.engine.events import TokenEvent
from minengine.engine.roofline import ReadCeiling, flop_shape, prefill_attention_flops, prefill_flops, step_intensity
from minengine.record import trace_io
from minengine.record.trace_io import read_trace
from reqscope.bench.ceiling import CALIBRATE_HINT, COMPUTE_HINT, machine_name, save_ceiling, stored_ceiling
from reqscope.cli import main

CPU = torch.device("cpu")


def _ceiling(bytes_per_s: float = 20e9) -> ReadCeiling:
    return ReadCeiling(bytes_per_s, "sum over 512 MiB, fastest of 15 passes", machine_name(CPU), "2026-12-01 10:00 UTC",
                       "reqscope calibrate")  # fmt: skip


def _json_run(model_dir, capsys, *extra) -> list[dict]:
    argv = ["--json", "--model", str(model_dir), "--device", "cpu", "--temperature", "0", "--max-tokens", "5",
            *extra, "hi"]  # fmt: skip
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_json_token_and_done_records_carry_the_roofline(chatty_tiny_dir, capsys, read_ceiling_file):
    save_ceiling(_ceiling(), read_ceiling_file)
    records = _json_run(chatty_tiny_dir, capsys)
    tokens = [r for r in records if r["event"] == "token"]
    first, steps = tokens[0], tokens[1:]
    assert first["bytes_read"] is None and first["roofline_ms"] is None and first["roofline_fraction"] is None
    for t in steps:
        assert t["bytes_read"] > t["kv_bytes_read"] > 0
        assert t["roofline_ms"] == pytest.approx(t["bytes_read"] / 20e9 * 1000, rel=1e-3)
        assert t["roofline_fraction"] == pytest.approx(t["roofline_ms"] / t["step_ms"], rel=2e-3)
    # Each step attends over one position more than the one before.
    per_position = steps[1]["kv_bytes_read"] - steps[0]["kv_bytes_read"]
    assert all(b["kv_bytes_read"] - a["kv_bytes_read"] == per_position for a, b in zip(steps, steps[1:], strict=False))
    roofline = records[-1]["roofline"]
    assert roofline["decode_steps"] == len(steps) >= 2  # a random tiny model: EOS could come early, never this early
    assert roofline["weight_bytes"] == steps[0]["bytes_read"] - steps[0]["kv_bytes_read"]
    assert roofline["mean_bytes_read"] == pytest.approx(sum(t["bytes_read"] for t in steps) / len(steps), abs=1)
    assert roofline["ceiling_bytes_per_s"] == 20e9 and roofline["ceiling"]["measured_at"] == "2026-12-01 10:00 UTC"
    assert roofline["ceiling_note"] == "reqscope calibrate, 2026-12-01 10:00 UTC"
    mean_step = sum(t["step_ms"] for t in steps) / len(steps)
    assert roofline["mean_step_ms"] == pytest.approx(mean_step, rel=1e-3)
    # Kept to 4 places: a small fraction on a busy machine is off by its rounding, not by 1e-3 of itself.
    assert roofline["roofline_fraction"] == pytest.approx(roofline["mean_roofline_ms"] / mean_step, rel=1e-3, abs=1e-4)
    assert roofline["roofline_tokens_per_s"] == pytest.approx(20e9 / roofline["mean_bytes_read"], rel=1e-3)
    half = roofline["mean_bytes_read"] - roofline["weight_bytes"] / 2
    assert roofline["roofline_tokens_per_s_half_weight_bytes"] == pytest.approx(20e9 / half, rel=1e-3)


def test_the_done_record_carries_prefills_compute_roofline_beside_decodes(chatty_tiny_dir, capsys):
    assert main(["calibrate", "--ceilings-only", "--model", str(chatty_tiny_dir), "--device", "cpu", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    compute, read = measured["compute_ceiling"], measured["read_ceiling"]
    records = _json_run(chatty_tiny_dir, capsys)
    prefill = next((r for r in records if r["event"] == "prefill"), None)  # its chunks, when it was cut
    done = records[-1]
    assert done["roofline"]["ceiling_bytes_per_s"] == round(read["bytes_per_s"])  # decode's memory roofline stays
    p = done["prefill_roofline"]
    shape = flop_shape(ModelConfig.from_file(chatty_tiny_dir / "config.json"), done["roofline"]["weight_bytes"])
    tokens = p["computed_tokens"]
    assert tokens > 0 and p["flops"] == prefill_flops(shape, tokens)
    assert p["flops_per_token"] == round(p["flops"] / tokens)
    assert p["attention_flops"] == prefill_attention_flops(shape, tokens) < p["flops"]
    assert p["attention_share"] == round(p["attention_flops"] / p["flops"], 4)
    assert p["flops_per_s"] == pytest.approx(p["flops"] / (p["prefill_ms"] / 1000), rel=1e-4)
    assert p["roofline_fraction"] == pytest.approx(p["flops_per_s"] / compute["flops_per_s"], rel=1e-3, abs=1e-4)
    assert p["ceiling_flops_per_s"] == round(compute["flops_per_s"]) and p["ceiling"]["path"] == compute["path"]
    ridge = compute["flops_per_s"] / read["bytes_per_s"]
    assert p["crossover_rows"] == pytest.approx(ridge / step_intensity(shape, 1), rel=1e-3, abs=0.01)
    assert p["step_rows"] == (tokens if prefill is None else max(c["tokens"] for c in prefill["chunks"]))
    assert p["bound"] == ("compute" if p["step_rows"] >= p["crossover_rows"] else "memory")


def test_without_a_ceiling_the_bytes_still_show_and_say_what_to_run(chatty_tiny_dir, capsys):
    records = _json_run(chatty_tiny_dir, capsys)
    steps = [r for r in records if r["event"] == "token"][1:]
    assert all(t["bytes_read"] > 0 and t["roofline_ms"] is None and t["roofline_fraction"] is None for t in steps)
    roofline = records[-1]["roofline"]
    assert roofline["ceiling"] is None and roofline["roofline_fraction"] is None
    assert CALIBRATE_HINT in roofline["ceiling_note"] and machine_name(CPU) in roofline["ceiling_note"]
    prefill = records[-1]["prefill_roofline"]
    assert prefill["flops"] > 0 and prefill["flops_per_s"] > 0  # the FLOPs need no ceiling
    assert prefill["roofline_fraction"] is None and prefill["crossover_rows"] is None and prefill["bound"] is None
    assert prefill["ceiling_note"].endswith(f"run {COMPUTE_HINT}")


def test_plain_summary_has_the_roofline_lines(chatty_tiny_dir, capsys, read_ceiling_file):
    save_ceiling(_ceiling(), read_ceiling_file)
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--device", "cpu", "--temperature", "0", "--max-tokens", "5",
            "hi"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    first, second = next(line for line in err.splitlines() if line.startswith("roofline")), None
    lines = err.splitlines()
    second = lines[lines.index(first) + 1]
    assert "ms/step allowed at 20.0 GB/s" in first and "of the ceiling (read ceiling: reqscope calibrate, " in first
    assert "MiB read per step = weights" in second and "with half the weight bytes" in second


def test_plain_summary_has_prefills_compute_roofline_after_its_prefill_line(chatty_tiny_dir, capsys):
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--device", "cpu", "--temperature", "0", "--max-tokens", "5",
            "hi"]  # fmt: skip
    assert main(argv) == 0  # no compute ceiling yet: the FLOPs, and what to run
    lines = capsys.readouterr().err.splitlines()
    first = lines[[line.split()[0] if line.split() else "" for line in lines].index("prefill") + 1]
    assert first.startswith("compute   prefill ") and " GFLOP/token, " in first
    assert first.endswith(f"run {COMPUTE_HINT}")
    assert "where compute binds needs both ceilings" in lines[lines.index(first) + 1]
    assert main(["calibrate", "--ceilings-only", "--model", str(chatty_tiny_dir), "--device", "cpu", "--json"]) == 0
    compute = json.loads(capsys.readouterr().out)["compute_ceiling"]
    assert main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    first = next(line for line in lines if line.startswith("compute   prefill "))
    second = lines[lines.index(first) + 1]
    reached, ceiling = first.split(" GFLOP/s = ")[0], f" of {compute['flops_per_s'] / 1e9:.1f} GFLOP/s"
    flops_per_s = float(reached.rsplit(", ", 1)[1]) * 1e9
    fraction = int(first.split(" GFLOP/s = ")[1].split("%")[0])
    assert ceiling + " (compute ceiling: reqscope calibrate, " in first and "% of the FLOPs" in first
    # both printed rounded: the FLOP/s to 0.1 GFLOP/s, the fraction to 1%
    low, high = ((flops_per_s + e) / compute["flops_per_s"] * 100 for e in (-0.05e9, 0.05e9))
    assert low - 0.5 <= fraction <= high + 0.5, (first, compute["flops_per_s"])
    assert second.strip().startswith("compute binds from ~") and second.endswith("-bound)")


def test_the_trace_keeps_the_bytes_and_the_ceiling_and_older_readers_skip_them(chatty_tiny_dir, tmp_path, capsys,
                                                                               read_ceiling_file):  # fmt: skip
    save_ceiling(_ceiling(), read_ceiling_file)
    export = tmp_path / "run"
    _json_run(chatty_tiny_dir, capsys, "--export", str(export))
    header, events = read_trace(export / "request-trace.jsonl")
    assert header.read_ceiling == _ceiling()
    steps = [e for e in events if isinstance(e, TokenEvent)][1:]
    assert steps and all(e.bytes_read is not None and e.bytes_read.total > 0 for e in steps)
    # A reader from before these fields decodes the same records, ignoring the keys it does not know.
    newer = ("read_ceiling", "settings", "compute_ceiling", "flop_shape")  # a reader from before they were kept
    old_header = dataclasses.make_dataclass(
        "TraceHeader", [(f.name, f.type) for f in dataclasses.fields(trace_io.TraceHeader) if f.name not in newer]
    )
    record = json.loads((export / "request-trace.jsonl").read_text().splitlines()[0])
    assert "read_ceiling" in record and not hasattr(trace_io.decode_value(old_header, record), "read_ceiling")
    assert record["flop_shape"]["layers"] == header.layers and header.flop_shape.layer_params > 0


def test_an_older_trace_reads_without_bytes_or_ceiling():
    from pathlib import Path

    header, events = read_trace(Path(__file__).parent.parent / "data" / "explorer-trace.jsonl")
    assert header.read_ceiling is None
    assert all(e.bytes_read is None for e in events if isinstance(e, TokenEvent))


def test_calibrate_ceiling_only_measures_and_keeps_it(capsys, read_ceiling_file):
    assert main(["calibrate", "--ceiling-only", "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"bytes_per_s", "probe", "machine", "measured_at", "source"}
    assert 1e8 < printed["bytes_per_s"] < 1e13 and printed["machine"] == machine_name(CPU)
    found = stored_ceiling(CPU, read_ceiling_file)
    # (on a machine busy with other work the note says so: tests/cli/test_calibrate.py)
    assert found.ceiling == ReadCeiling(**printed)
    assert found.note.startswith(f"reqscope calibrate, {printed['measured_at']}")
    # Measured again, it replaces this machine's entry and keeps another machine's.
    other = dataclasses.replace(_ceiling(), machine="cuda Some GPU")
    save_ceiling(other, read_ceiling_file)
    assert main(["calibrate", "--ceiling-only", "--device", "cpu"]) == 0
    assert "read ceiling " in capsys.readouterr().out
    kept = json.loads(read_ceiling_file.read_text())["ceilings"]
    assert sorted(c["machine"] for c in kept) == sorted([machine_name(CPU), "cuda Some GPU"])


def test_an_unreadable_ceiling_file_is_no_ceiling(read_ceiling_file):
    read_ceiling_file.write_text("not json")
    found = stored_ceiling(CPU, read_ceiling_file)
    assert found.ceiling is None and CALIBRATE_HINT in found.note
