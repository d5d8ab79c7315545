"""The benchmark: its arithmetic on synthetic inputs, a smoke run on a tiny model, gpu-check's refusal.

Nothing here times anything against a target; speed targets live in the benchmark's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minengine.checkpoint.mapped_pages import MappedFiles
from minengine.kv.arithmetic import MIB
from reqscope.bench.read_probe import (
    achieved_bandwidth,
    decode_bytes_per_step,
    roofline_fraction,
    roofline_tokens_per_second,
)
from reqscope.bench.report import targets, to_json
from reqscope.bench.schedule import BenchConfig, run_bench
from reqscope.bench.stats import Spread, overhead_percent, ratios

ROOT = Path(__file__).resolve().parent.parent.parent

# -- arithmetic ----------------------------------------------------------------------------------


def test_spread_is_median_min_max():
    s = Spread.of([5.0, 1.0, 3.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 5.0, 4)
    assert Spread.of([7.0]).median == 7.0
    assert s.scaled(2.0) == Spread(5.0, 2.0, 10.0, 4)
    with pytest.raises(ValueError):
        Spread.of([])


def test_ratios_pair_rounds_not_medians():
    # Round 1 both fast, round 2 both slow: per-round ratios are 2.0 and 2.0, while a ratio of
    # medians of these skewed lists would not be.
    ours, theirs = [40.0, 10.0, 30.0], [20.0, 5.0, 5.0]
    assert ratios(ours, theirs) == [2.0, 2.0, 6.0]
    assert Spread.of(ratios(ours, theirs)).median == 2.0
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])


def test_overhead_percent_from_rates():
    # 95 tok/s instrumented against 100 bare: the bare loop is 5.26% faster.
    assert overhead_percent([95.0, 100.0], [100.0, 100.0]) == pytest.approx([100 / 95 * 100 - 100, 0.0])


def test_decode_bytes_count_weights_and_every_visible_position():
    # 3 steps after a 5-token prompt attend over 6, 7 and 8 positions: 7 on average.
    assert decode_bytes_per_step(1000, 10, prompt_tokens=5, steps=3) == 1000 + 10 * 7
    assert decode_bytes_per_step(1000, 10, prompt_tokens=0, steps=1) == 1010


def test_roofline_math():
    per_step = 540e6
    achieved = achieved_bandwidth(per_step, 50.0)
    assert achieved == 27e9
    assert roofline_fraction(achieved, 40e9) == pytest.approx(0.675)
    assert roofline_tokens_per_second(per_step, 40e9) == pytest.approx(74.07, abs=0.01)
    with pytest.raises(ValueError):
        roofline_fraction(1.0, 0.0)


# -- the peak-memory helper ------------------------------------------------------------------------


def test_mapped_pages_are_released_only_for_file_mappings(tmp_path):
    from safetensors import safe_open

    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: many whole pages
    save_file({"w": big}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("w")
        pages = MappedFiles()
        if not pages.ranges:
            pytest.skip("no /proc/self/maps here")
        assert pages.release(mapped)
        assert torch.equal(mapped, big)  # dropped pages fault back in from the file
    anonymous = big.clone()
    assert not MappedFiles().release(anonymous)  # never advised: that would zero it
    assert torch.equal(anonymous, big)


# -- targets on a synthetic report -------------------------------------------------------------------


def _synthetic_report(smoke_report, **changes):
    return replace(smoke_report, **changes)


def test_targets_follow_the_numbers(smoke_report):
    # The decode target reads the fair comparison (each engine in its own process); it used to read
    # the in-process one, where transformers ran under reqscope's OpenMP policy.
    fair_side = replace(smoke_report.fair.side("reqscope"), vs_transformers=Spread(1.6, 1.5, 1.7, 3))
    good = _synthetic_report(
        smoke_report,
        fair=replace(smoke_report.fair, sides=(fair_side, *smoke_report.fair.sides[1:])),
        roofline=replace(
            smoke_report.roofline, matvec_fraction=Spread(0.61, 0.6, 0.7, 3), fraction=Spread(0.5, 0.4, 0.6, 3)
        ),
        prefill_long=replace(smoke_report.prefill_long, speedup=Spread(1.0, 0.9, 1.1, 3)),
        explorer=replace(smoke_report.explorer, overhead_percent=Spread(4.9, 1.0, 8.0, 3), same_tokens=True),
    )
    by_name = {t.name.split(" (")[0]: t.passed for t in targets(good)}
    assert by_name["decode speed vs transformers"]
    assert by_name["decode bandwidth / measured roofline"]
    assert by_name["explorer overhead on decode"]
    slow_side = replace(fair_side, vs_transformers=Spread(1.49, 1.4, 1.6, 3))
    bad = _synthetic_report(
        good,
        fair=replace(good.fair, sides=(slow_side, *good.fair.sides[1:])),
        roofline=replace(good.roofline, matvec_fraction=Spread(0.59, 0.5, 0.7, 3), fraction=Spread(0.9, 0.8, 1.0, 3)),
        explorer=replace(good.explorer, overhead_percent=Spread(5.1, 1.0, 8.0, 3)),
    )
    by_name = {t.name: t.passed for t in targets(bad)}
    assert not by_name["decode bandwidth / measured roofline (matvec probe)"]
    assert not by_name["decode speed vs transformers"]
    assert not by_name["explorer overhead on decode"]
    memory = replace(good.memory, peak_rss_bytes=good.memory.budget_bytes + 1)
    assert not {t.name: t.passed for t in targets(replace(good, memory=memory))}["peak memory of reqscope --plain"]


def test_the_no_collapse_target_sets_the_loaded_pass_against_the_idle_one(smoke_report):
    name = "decode beside one busy process / idle (no collapse)"
    assert name not in {t.name for t in targets(smoke_report)}  # only when --under-load ran
    ours = smoke_report.fair.side("reqscope")

    def with_loaded_rate(rate: float):
        side = replace(ours, decode_tokens_per_s=Spread(rate, rate, rate, 1))
        loaded = replace(smoke_report.fair, sides=(side, *smoke_report.fair.sides[1:]))
        return {t.name: t.passed for t in targets(replace(smoke_report, fair_under_load=loaded))}[name]

    idle = ours.decode_tokens_per_s.median
    assert with_loaded_rate(0.6 * idle) and not with_loaded_rate(0.4 * idle)


# -- a smoke run on a tiny model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_report(chatty_tiny_dir):
    config = BenchConfig(
        model_dir=chatty_tiny_dir,
        device="cpu",
        dtype="float32",
        rounds=2,
        new_tokens=6,
        long_prompt_tokens=48,
        warm_launches=1,
        launch_max_tokens=4,
        probe_bytes=8 * MIB,
    )
    return run_bench(config)


def test_smoke_run_produces_every_key(smoke_report):
    data = json.loads(json.dumps(to_json(smoke_report)))  # must be plain JSON
    assert set(data) >= {
        "machine", "config", "fair", "fair_under_load", "short_prompt_tokens", "prefill_short", "prefill_long",
        "decode", "parity",
        "roofline", "explorer", "start", "memory", "device_memory", "targets",
    }  # fmt: skip
    for key in ("prefill_short", "prefill_long", "decode"):
        assert set(data[key]) == {"unit", "minengine", "transformers", "speedup"}
        assert set(data[key]["speedup"]) == {"median", "min", "max", "n"}
        assert data[key]["speedup"]["n"] == 2 and data[key]["speedup"]["median"] > 0
    assert data["prefill_long"]["minengine"]["median"] > 0
    assert data["machine"]["weight_bytes"] > 0 and data["machine"]["kv_bytes_per_token"] > 0
    assert 0 < data["roofline"]["fraction"]["median"] <= data["roofline"]["matvec_fraction"]["median"] < 5
    assert data["roofline"]["bytes_per_step"] > data["machine"]["decode_weight_bytes"] > 0
    # Same model, same ids, float32 on both sides: greedy decode agrees token for token.
    assert data["parity"] == {"tokens": 6, "matching_prefix": 6, "identical": True}
    assert data["explorer"]["same_tokens"] is True
    assert data["start"]["cold_first_token_s"] > 0 and data["start"]["heavy_imports"] == []
    assert data["memory"]["peak_rss_bytes"] > data["memory"]["weight_bytes"]
    assert data["device_memory"] is None  # CPU
    assert {t["name"] for t in data["targets"]} >= {"decode speed vs transformers", "explorer overhead on decode"}
    # The fair comparison: both sides through pipes, each with its environment named.
    fair = data["fair"]
    assert [side["name"] for side in fair["sides"]][:2] == ["reqscope", "transformers"]
    assert fair["decode_speedup"]["n"] == 2 and fair["parity"]["identical"] is True
    for side in fair["sides"]:
        assert side["decode_tokens_per_s"]["median"] > 0 and side["environment"]["threads"] >= 1
    assert data["fair_under_load"] is None


def test_smoke_report_reads_as_a_table(smoke_report):
    from reqscope.bench.report import format_table

    text = format_table(smoke_report)
    assert "decode 6 tokens (tok/s)" in text and "prefill 48 tokens (ms)" in text
    assert text.index("fair comparison (idle machine)") < text.index("in-process comparison (secondary)")
    verdicts = [line.split()[0] for line in text.split("targets:")[1].strip().splitlines()]
    assert len(verdicts) == len(targets(smoke_report)) and set(verdicts) <= {"PASS", "FAIL"}


def test_explorer_and_bare_loop_step_in_turn(chatty_tiny_dir):
    from minengine.engine.engine import Engine
    from minengine.engine.request import GenerationRequest
    from minengine.sampling.params import SamplingParams
    from reqscope.bench.runs import explorer_beside_bare, greedy_decode

    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32")
    request = GenerationRequest.from_prompt("hi", sampling=SamplingParams(temperature=0.0), max_tokens=7, trace=True)
    ids = engine.tokenizer.encode(engine.tokenizer.render(list(request.messages)))
    bare, explorer = explorer_beside_bare(engine, request, ids)
    assert bare.tokens == explorer.tokens == greedy_decode(engine.runner, ids, len(bare.tokens)).tokens
    # One clocked decode step per token after the first (which ends each prefill), on both sides.
    assert len(bare.step_ms) == len(explorer.step_ms) == len(explorer.tokens) - 1 >= 1
    assert min(bare.step_ms) > 0 and min(explorer.step_ms) > 0
    # With the static step (CUDA graphs on a GPU; run eagerly here) there is one K/V arena, so the
    # runs take turns, each borrowing it: both decode through it, and the tokens are the same.
    engine.runner.use_static_decode(True, capture=False)
    lent = []
    original = engine.runner.static_decoder.new_cache
    engine.runner.static_decoder.new_cache = lambda *a, **k: lent.append(original(*a, **k)) or lent[-1]
    static_bare, static_explorer = explorer_beside_bare(engine, request, ids)
    assert static_bare.tokens == static_explorer.tokens == bare.tokens
    assert len(lent) == 2 and all(cache is not None for cache in lent)


def test_decode_runs_between_probe_passes(chatty_tiny_dir):
    from minengine.engine.engine import Engine
    from reqscope.bench.read_probe import ReadProbe
    from reqscope.bench.runs import decode_beside_probes

    engine = Engine(chatty_tiny_dir, device="cpu", dtype="float32")
    probe = ReadProbe(torch.device("cpu"), torch.float32, nbytes=4 * MIB)
    assert 3.5 * MIB <= probe.nbytes <= 4 * MIB  # whole rows of the probe's matrix
    run = decode_beside_probes(engine.runner, [1, 2, 3], 6, probe)
    probe.release()
    assert run.steps == 5 and run.probe_bytes == probe.nbytes
    assert run.tokens_per_second > 0 and run.matvec_bytes_per_second > 0 and run.sum_bytes_per_second > 0
    # Rates are totals over the run: 5 passes of each probe, 5 decode steps.
    assert run.matvec_bytes_per_second == pytest.approx(5 * probe.nbytes / run.matvec_seconds)


# -- gpu-check -------------------------------------------------------------------------------------------


def test_gpu_check_refuses_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], done.stderr


def test_gpu_check_summary_reads_the_bench_report(smoke_report):
    # The summary's keys track the report's: a renamed field would otherwise surface only on a GPU.
    import runpy

    gpu_check = runpy.run_path(str(ROOT / "scripts" / "gpu-check"), run_name="gpu_check")
    summary = gpu_check["summary"](json.loads(json.dumps(to_json(smoke_report))))
    assert summary["decode_speedup_vs_transformers"] == smoke_report.fair.decode_speedup.median
    assert summary["in_process_decode_speedup"] == smoke_report.decode.speedup.median
    assert summary["decode_tokens_per_s"] == smoke_report.fair.side("reqscope").decode_tokens_per_s.median
    assert summary["hbm_roofline_fraction_of_matvec_probe"] == smoke_report.roofline.matvec_fraction.median
    assert summary["kv_bytes_computed"] is None  # CPU: no device memory section


def test_bench_command_prints_json_with_every_target(chatty_tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "reqscope.bench", "--model", str(chatty_tiny_dir), "--device", "cpu"]
    cmd += ["--dtype", "float32", "--rounds", "1", "--output-len", "4", "--long-input-len", "24"]
    cmd += ["--launches", "0", "--json", "--output", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout)
    assert printed == json.loads(out.read_text(encoding="utf-8"))
    names = {t["name"] for t in printed["targets"]}
    assert "decode bandwidth / measured roofline (matvec probe)" in names and "explorer overhead on decode" in names
    assert printed["start"] is None and printed["roofline"]["probe_bytes"] > 0
    assert printed["roofline"]["decode_tokens_per_s"]["n"] == 1
