"""`reqscope calibrate`: the service-time lines fitted by least squares, saved, and used by `plan`; the
compute ceiling of the model's prefill path measured, kept beside the read ceiling, and read back."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from minengine.engine.roofline import ComputeCeiling, ReadCeiling
from minengine.plan.compute_ceiling import COMPUTE_ROWS
from minengine.plan.service_model import CalibrationError, Point, ServiceModel, fit_line
from reqscope.bench.ceiling import COMPUTE_HINT, machine_name, stored_ceiling, stored_compute_ceiling
from reqscope.cli import main

CPU = torch.device("cpu")


def test_an_exact_line_is_recovered_with_r2_one():
    tokens = [16, 64, 256, 1024]
    fit = fit_line(tokens, [20 + 0.035 * n for n in tokens], "prefill")  # seed 003's model
    assert fit.fixed_ms == pytest.approx(20) and fit.per_token_ms == pytest.approx(0.035)
    assert fit.r2 == pytest.approx(1.0)


def test_fit_and_r2_agree_with_numpy():
    rng = np.random.default_rng(0)
    x = np.repeat([16, 64, 256, 512], 3)
    y = 30 + 2.5 * x + rng.normal(0, 40, x.size)
    fit = fit_line(x.tolist(), y.tolist(), "prefill")
    slope, fixed = np.polyfit(x, y, 1)
    r2 = 1 - ((y - (fixed + slope * x)) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert (fit.fixed_ms, fit.per_token_ms, fit.r2) == pytest.approx((fixed, slope, r2))


def test_costs_never_come_out_negative():
    tokens = [10, 20, 30, 40]
    through_below_zero = fit_line(tokens, [0.5, 3.0, 5.5, 8.0], "prefill")  # lstsq: -2 + 0.25 x
    assert through_below_zero.fixed_ms == 0.0 and through_below_zero.per_token_ms > 0
    falling = fit_line(tokens, [31.0, 30.0, 30.5, 29.0], "decode")  # noise, no real growth
    assert falling.per_token_ms == 0.0 and falling.fixed_ms == pytest.approx(30.125)


@pytest.mark.parametrize(
    ("tokens", "ms", "needle"),
    [([16, 64], [1.0, 2.0], "at least 3 points"), ([64, 64, 64], [1.0, 2.0, 3.0], "2 or more lengths"),
     ([1, 2, 3], [1.0, math.nan, 3.0], "not finite")],
)  # fmt: skip
def test_too_few_points_or_non_finite_ones_are_refused(tokens, ms, needle):
    with pytest.raises(CalibrationError, match=needle):
        fit_line(tokens, ms, "prefill")


def test_mean_itl_is_the_decode_line_at_the_mean_context():
    points = [Point("prefill", n, 10 + n) for n in (1, 2, 3)] + [Point("decode", n, 5 + 0.5 * n) for n in (1, 2, 3)]
    model = ServiceModel.fit("m", "cpu", "float32", points)
    assert model.mean_itl_ms(100, 21) == pytest.approx(5 + 0.5 * (100 + 10.5))


def test_calibrate_on_a_model_then_plan_with_its_fit(chatty_tiny_dir, tmp_path, capsys):
    saved = tmp_path / "service.json"
    argv = ["calibrate", "--model", str(chatty_tiny_dir), "--device", "cpu", "--prompt-lengths", "8,32,128",
            "--context-lengths", "8,32,128", "--repeats", "2", "--decode-steps", "2",
            "--json", "--output", str(saved)]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "device", "dtype", "prefill", "decode", "points"}
    assert set(out["prefill"]) == {"fixed_ms", "per_token_ms", "r2"}
    assert set(out["decode"]) == {"fixed_ms", "per_context_token_ms", "r2"}
    assert len(out["points"]) == 2 * (3 + 3) and json.loads(saved.read_text()) == out
    assert out["prefill"]["fixed_ms"] >= 0 and out["prefill"]["per_token_ms"] >= 0
    fit = ServiceModel.load(saved)
    assert main(["plan", "smollm2-135m-instruct", "--input-len", "100", "--output-len", "11",
                 "--service-model", str(saved), "--json"]) == 0  # fmt: skip
    planned = json.loads(capsys.readouterr().out)
    assert planned["ttft_ms"] == pytest.approx(fit.ttft_ms(100))  # no network or queue given
    assert planned["tpot_ms"] == pytest.approx(fit.mean_itl_ms(100, 11))


def test_text_mode_shows_the_seed_beside_the_fit(chatty_tiny_dir, capsys):
    argv = ["calibrate", "--model", str(chatty_tiny_dir), "--device", "cpu", "--prompt-lengths", "8,16,32",
            "--context-lengths", "8,16,32", "--repeats", "1", "--decode-steps", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill_ms = " in out and "seed 003: 20 + 0.035 x prompt tokens" in out and "o" in out


@pytest.mark.parametrize(
    ("content", "needle"),
    [("{}", "is not a service model"), ("not json", "is not a service model"),
     ('{"model": "m", "device": "cpu", "dtype": "f", "prefill": {"fixed_ms": NaN, "per_token_ms": 1, "r2": 1},'
      ' "decode": {"fixed_ms": 1, "per_context_token_ms": 0, "r2": 1}}', "not finite")],
)  # fmt: skip
def test_a_bad_service_model_file_is_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "s.json"
    path.write_text(content)
    assert main(["plan", "smollm2-135m-instruct", "--input-len", "5", "--service-model", str(path)]) == 1
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_lengths_the_context_cannot_hold_are_refused(chatty_tiny_dir, capsys):
    argv = ["calibrate", "--model", str(chatty_tiny_dir), "--device", "cpu", "--prompt-lengths", "8,99999"]
    assert main(argv) == 1
    assert "only 1 prompt length(s) fit the model's context of 2048" in capsys.readouterr().err


def test_calibrate_measures_the_compute_ceiling_keeps_it_and_reads_it_back(chatty_tiny_dir, capsys, read_ceiling_file):
    assert main(["calibrate", "--ceilings-only", "--model", str(chatty_tiny_dir), "--device", "cpu", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    compute, read = printed["compute_ceiling"], printed["read_ceiling"]
    assert compute["flops_per_s"] > 0 and compute["rows"] in COMPUTE_ROWS
    assert f"over {compute['rows']} rows (of 256 and 1024), fastest of 5 passes" in compute["probe"]
    # the model, the weights' format it chose, the compute dtype, what a prompt's products multiply (and on what)
    name, weights, dtype, products = compute["path"].split(", ")
    assert name == chatty_tiny_dir.name and weights.endswith(" weights") and dtype == "float32"
    rows = r"(int16|int8|float32|bfloat16|float16)(×\w+)?"
    assert re.fullmatch(rows + r"( on AMX tiles( emulated in C)?)? products", products), products
    assert compute["machine"] == read["machine"] == machine_name(CPU)
    found = stored_compute_ceiling(CPU, compute["path"], read_ceiling_file)
    # (a machine busy with other work adds a mark to the note: a later test's point)
    assert found.ceiling == ComputeCeiling(**compute)
    assert found.note.startswith(f"reqscope calibrate, {compute['measured_at']}")
    assert stored_ceiling(CPU, read_ceiling_file).ceiling == ReadCeiling(**read)  # kept beside, in the same file
    # The read ceiling measured again (--ceiling-only, no model) keeps the compute ceiling.
    assert main(["calibrate", "--ceiling-only", "--device", "cpu"]) == 0
    assert stored_compute_ceiling(CPU, compute["path"], read_ceiling_file).ceiling == ComputeCeiling(**compute)
    # Another path (weights, dtype or model) has none yet, and says what to run.
    other = stored_compute_ceiling(CPU, "another model, q4_1 weights, float32", read_ceiling_file)
    assert other.ceiling is None and "compute ceiling not measured" in other.note and COMPUTE_HINT in other.note


def test_the_compute_ceiling_is_the_faster_chunk_size_and_names_it(chatty_tiny_dir, monkeypatch):
    # A float32 GEMM that lays each weight out again per product runs faster over more rows: the
    # ceiling must be the rate of the faster size, or a long prompt's prefill reads above it.
    from minengine.engine.engine import Engine
    from minengine.plan import compute_ceiling

    engine = Engine(chatty_tiny_dir, device="cpu")
    timed = {rows: compute_ceiling.projections_rate(engine, rows, 1) for rows in COMPUTE_ROWS}
    assert all(rate > 0 for rate in timed.values())
    rates = {256: 91e9, 1024: 130e9}
    monkeypatch.setattr(compute_ceiling, "projections_rate", lambda engine, rows, passes: rates[rows])
    ceiling = compute_ceiling.measure_compute_ceiling(engine, "cpu test, 2 threads", "a test")
    assert (ceiling.flops_per_s, ceiling.rows) == (130e9, 1024)
    assert "over 1024 rows (of 256 and 1024), fastest of 5 passes" in ceiling.probe
    rates[256] = 140e9
    assert compute_ceiling.measure_compute_ceiling(engine, "cpu test", "a test").rows == 256


def test_a_ceiling_file_from_before_compute_ceilings_still_loads(read_ceiling_file):
    entry = {"bytes_per_s": 3e10, "probe": "sum over 512 MiB", "machine": machine_name(CPU),
             "measured_at": "2026-12-01 10:00 UTC", "source": "reqscope calibrate"}  # fmt: skip
    old = {"version": 1, "ceilings": [entry]}  # as written before the compute ceilings were kept
    read_ceiling_file.write_text(json.dumps(old))
    assert stored_ceiling(CPU, read_ceiling_file).ceiling.bytes_per_s == 3e10
    missing = stored_compute_ceiling(CPU, "SmolLM2-135M-Instruct, q4_1 weights, float32", read_ceiling_file)
    assert missing.ceiling is None and missing.note.endswith(f"run {COMPUTE_HINT}")


def test_other_processes_load_is_measured_apart_from_this_ones():
    from reqscope.bench.other_load import OtherLoadMeter

    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.5)  # the child is spinning
        with OtherLoadMeter() as meter:
            time.sleep(1.0)
        busy = meter.load
    finally:
        spinner.wait()
    assert busy.cores > 0.6 and busy.disturbed and "other processes used" in busy.describe()
    began = time.monotonic()
    with OtherLoadMeter() as meter:
        while time.monotonic() - began < 0.5:  # this process's own work is not the others'
            pass
    assert meter.load.cores < 0.5


def test_a_ceiling_measured_under_load_is_marked_and_warned_of(capsys, read_ceiling_file, monkeypatch):
    from reqscope.bench.other_load import OtherLoad
    from reqscope.commands import calibrate

    class Busy:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.load = OtherLoad(cores=1.6, span_s=2.0, machine_cores=2)

    monkeypatch.setattr(calibrate, "OtherLoadMeter", Busy)
    assert main(["calibrate", "--ceiling-only", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: other processes used 1.6 of 2 cores while the read ceiling" in err
    found = stored_ceiling(CPU, read_ceiling_file)
    assert found.ceiling.probe.endswith("; other processes used 1.6 of 2 cores meanwhile")
    assert found.note.endswith("(other processes busy then)")
