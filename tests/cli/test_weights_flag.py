"""`--weights` on every verb that opens an engine; which format ran, and why, in --plain and --json; bad values."""

from __future__ import annotations

import json

import pytest

from minengine.checkpoint import layout_cache
from minengine.fast.cpu_kernels import library
from minengine.fast.linear_kernels import available
from reqscope import cli


@pytest.mark.parametrize("verb", ["run", "serve", "bench", "calibrate", "web"])
def test_every_verb_that_opens_an_engine_takes_the_flag(verb):
    assert "--weights {auto,float32,fp16,bf16,int8,q8_0,q4_1}" in cli.build_parser(verb).format_help()


def test_json_and_plain_say_which_format_ran_and_why(chatty_tiny_dir, capsys, monkeypatch):
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "0")
    argv = ["--model", str(chatty_tiny_dir), "--temperature", "0", "--max-tokens", "2"]
    assert cli.main(["--json", *argv, "--weights", "float32", "hi"]) == 0
    done = json.loads(capsys.readouterr().out.splitlines()[-1])
    kernel = ", through reqscope's panel kernel" if library().lib is not None else f"; dense, since {library().why_not}"
    assert done["event"] == "done" and done["weights"] == {"format": "float32", "why": "asked for" + kernel}
    assert cli.main(["--plain", *argv, "hi"]) == 0
    model_line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("· model"))
    assert ", weights " in model_line and "(auto: " in model_line


def test_a_format_this_machine_lacks_is_one_line_and_writes_nothing(chatty_tiny_dir, capsys, tmp_path, monkeypatch):
    missing = next((f for f in ("bf16", "int8", "fp16") if not available(f).ok), None)
    if missing is None:
        pytest.skip("this CPU and torch run every packed kernel")
    monkeypatch.setenv(layout_cache.DISABLE_ENV, "1")
    export = tmp_path / "out"
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--weights", missing, "--export", str(export), "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"reqscope: error: {missing} weights cannot run: ")
    assert "--weights" in err[-1] and "Traceback" not in "".join(err)
    assert not any(export.iterdir()) if export.exists() else True
    assert not (chatty_tiny_dir / layout_cache.CACHE_DIR).exists()


def test_int8_with_compute_it_cannot_serve_is_one_line(chatty_tiny_dir, capsys):
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--dtype", "bfloat16", "--weights", "int8", "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "reqscope: error: int8 weights need float32 compute on the CPU; this run computes in bfloat16: "
        "use --dtype float32 or --weights bf16"
    )
