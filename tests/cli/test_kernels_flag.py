"""`--kernels reference|fast`: every verb that opens an engine takes it, and the reference gives the
default's greedy text on the default model, each token record naming the path that ran."""

from __future__ import annotations

import json

import pytest

from minengine.fast.panel_kernels import activations
from reqscope import cli

KYOTO = "Show me wheelchair-accessible hotels in Kyoto"


@pytest.mark.parametrize("verb", ["run", "serve", "bench", "calibrate"])
def test_every_verb_that_opens_an_engine_takes_the_flag(verb):
    assert "--kernels {fast,reference}" in cli.build_parser(verb).format_help()


def _tokens(capsys, *flags: str) -> list[dict]:
    assert cli.main(["--json", "--temperature", "0", "--max-tokens", "32", *flags, KYOTO]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [r for r in records if r["event"] == "token"]


def test_the_reference_gives_the_default_greedy_text_on_the_default_model(default_model_dir, capsys):
    fast = _tokens(capsys, "--model", str(default_model_dir))
    reference = _tokens(capsys, "--model", str(default_model_dir), "--kernels", "reference")
    assert [t["token_id"] for t in reference] == [t["token_id"] for t in fast]
    assert {t["path"] for t in reference} == {"reference"}
    # prefill: the whole prompt in one C call where the weights read DOT8 copies, else the general path
    rows = activations()
    assert fast[0]["path"] == ("torch general" if rows == "float32" else f"c-stack prompt {rows}×q4_1")
    assert len({t["path"] for t in fast[1:]}) == 1 and "reference" not in fast[1]["path"]


def test_a_fast_weight_format_under_the_reference_is_one_line(chatty_tiny_dir, capsys):
    argv = ["--plain", "--model", str(chatty_tiny_dir), "--kernels", "reference", "--weights", "q8_0", "hi"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "reqscope: error: weights 'q8_0' is a fast-path format, and the reference kernels keep the weights dense "
        "in float32; drop --weights or leave --kernels at fast"
    )
