"""`reqscope bench`'s weight formats: each format a side of its own, real processes on a tiny model.

No timing is asserted: the rows' figures are checked for where they come from (the child's own
bytes against the engine's arithmetic, the fraction against its formula, the skipped formats
against the engine's own refusal).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minengine.checkpoint.weight_format import WeightFormatError, resolve_weights
from minengine.engine.engine import Engine
from minengine.kv.arithmetic import kv_bytes_per_token
from reqscope.bench.fair.compare import REQSCOPE, TRANSFORMERS, run_fair
from reqscope.bench.fair.peers import PeerSelection
from reqscope.bench.formats import EVERY_FORMAT, format_rows, plan_formats
from reqscope.bench.read_probe import decode_bytes_per_step
from reqscope.bench.report import format_formats
from reqscope.bench.schedule import BenchConfig, _engine, _long_prefills, fair_contenders

ROOT = Path(__file__).resolve().parent.parent.parent
PACKED = ("fp16", "bf16", "int8", "q8_0", "q4_1")


def _runs_here(fmt: str) -> bool:
    try:
        resolve_weights(fmt, torch.device("cpu"), torch.float32)
    except WeightFormatError:
        return False
    return True


def test_each_format_runs_as_its_own_side_with_its_own_bytes_and_prefills(chatty_tiny_dir):
    config = BenchConfig(model_dir=chatty_tiny_dir, device="cpu", dtype="float32", weights="float32", rounds=1,
                         new_tokens=5, long_prompt_tokens=40, formats=EVERY_FORMAT)  # fmt: skip
    engine = _engine(config)
    plan = plan_formats(config.formats, engine)
    runs = tuple(f for f in PACKED if _runs_here(f))
    assert plan.formats == runs
    assert {s.format for s in plan.skipped} == set(PACKED) - set(runs)
    for skip in plan.skipped:  # the engine's own refusal, in the app's words
        assert "cannot run" in skip.why_not and "--weights" in skip.why_not
    contenders = fair_contenders(config, engine, PeerSelection((), ()), plan.formats)
    assert [c.name for c in contenders] == [REQSCOPE, TRANSFORMERS, *(f"{REQSCOPE} {f}" for f in runs)]
    for c in contenders[2:]:
        assert c.argv[c.argv.index("--weights") + 1] == c.name.split()[1] and "--json" in c.argv
    fair = run_fair(contenders, rounds=1, new_tokens=5)
    cfg = engine.cfg
    per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4)
    for fmt in runs:
        side = fair.side(f"{REQSCOPE} {fmt}")
        assert side.tokens == 5 and side.decode_tokens_per_s.median > 0 and side.first_token_ms is not None
        other = Engine(chatty_tiny_dir, device="cpu", dtype="float32", weights=fmt, kv_budget_bytes=64 << 20)
        # What the child reported its steps read: its format's weights and the K/V at each position.
        expected = decode_bytes_per_step(other.model.decode_weight_bytes, per_token, side.prompt_tokens, 4)
        assert side.bytes_per_token == pytest.approx(expected, rel=0.02)
        assert side.bytes_per_token < fair.side(REQSCOPE).bytes_per_token
    long = _long_prefills(config, engine, plan, lambda message: None)
    assert set(long) == {"float32", *runs}
    for prefill in long.values():
        assert abs(prefill.prompt_tokens - 40) <= 3 and prefill.first_token_ms.n == 1
        assert prefill.peak_rss_bytes > 0
    names = {"float32": REQSCOPE} | {f: f"{REQSCOPE} {f}" for f in runs}
    result = format_rows(fair, names, long, plan.skipped, ceiling_bytes_per_s=1e10)
    assert [row.format for row in result.rows] == ["float32", *runs] and result.peer is None
    for row in result.rows:
        side = fair.side(row.side)
        assert row.ceiling_fraction == pytest.approx(side.bytes_per_token * side.decode_tokens_per_s.median / 1e10)
        assert row.vs_transformers == side.vs_transformers and row.prefill_short_ms == side.first_token_ms
    text = "\n".join(format_formats(result))
    for fmt in ("float32", *runs):
        assert any(line.startswith(f"{fmt} ") for line in text.splitlines())
    for skip in plan.skipped:
        assert f"skipped {skip.format}: " in text


def test_the_command_reports_every_format_in_json_and_skips_what_the_machine_lacks(chatty_tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "reqscope.bench", "--model", str(chatty_tiny_dir), "--device", "cpu"]
    cmd += ["--dtype", "float32", "--weights", "float32", "--rounds", "1", "--output-len", "4"]
    cmd += ["--long-input-len", "24", "--launches", "0", "--no-peers", "--formats", ",".join(PACKED)]
    cmd += ["--json", "--output", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text(encoding="utf-8"))
    runs = [f for f in PACKED if _runs_here(f)]
    rows = data["formats"]["rows"]
    assert [row["format"] for row in rows] == ["float32", *runs]
    assert [s["format"] for s in data["formats"]["skipped"]] == [f for f in PACKED if f not in runs]
    for row in rows:
        assert row["decode_tokens_per_s"]["median"] > 0 and row["bytes_per_step"] > 0
        assert row["long"]["first_token_ms"]["median"] > 0 and row["long"]["peak_rss_bytes"] > 0
    assert [s["name"] for s in data["fair"]["sides"]] == ["reqscope", "transformers", *(f"reqscope {f}" for f in runs)]


def test_an_unknown_format_is_one_line_and_fails_fast(tmp_path):
    cmd = [sys.executable, "-m", "reqscope.bench", "--model", str(tmp_path), "--formats", "fp16,q4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["bench: error: --formats got q4; give all, none or some of "
                                                "float32, fp16, bf16, int8, q8_0, q4_1"]  # fmt: skip
