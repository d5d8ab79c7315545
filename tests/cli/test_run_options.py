"""Run flags: `--cuda-graph/--no-cuda-graph` on a machine with and without CUDA."""

from __future__ import annotations

import argparse

import pytest
import torch

from reqscope.cli import build_parser, main
from reqscope.run_options import ModelFolder, open_engine


def _args(*argv: str) -> argparse.Namespace:
    return build_parser("run").parse_args([*argv, "hi"])


def test_the_flag_defaults_to_the_engines_choice():
    assert _args().cuda_graph is None
    assert _args("--cuda-graph").cuda_graph is True
    assert _args("--no-cuda-graph").cuda_graph is False


def test_asking_for_cuda_graphs_on_the_cpu_is_one_line(chatty_tiny_dir, capsys):
    code = main(["--plain", "--device", "cpu", "--cuda-graph", "--model", str(chatty_tiny_dir), "hi"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        "reqscope: error: --cuda-graph needs a CUDA device; this run is on the CPU (drop it, or use --device cuda)"
    ]


def test_turning_cuda_graphs_off_on_the_cpu_changes_nothing(chatty_tiny_dir):
    args = _args("--device", "cpu", "--no-cuda-graph", "--model", str(chatty_tiny_dir))
    engine = open_engine(args, ModelFolder.of(args))
    assert engine.device.type == "cpu" and engine.runner.static_decoder is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("flag", "static"), [("--cuda-graph", True), ("--no-cuda-graph", False)])
def test_the_flag_switches_the_static_decoder_on_cuda(chatty_tiny_dir, flag, static):
    args = _args("--device", "cuda", flag, "--model", str(chatty_tiny_dir))
    engine = open_engine(args, ModelFolder.of(args))
    assert (engine.runner.static_decoder is not None) is static


def test_the_model_folder_is_found_once_from_the_flags(chatty_tiny_dir, monkeypatch):
    from minengine.hub import pull

    given = ModelFolder.of(_args("--model", str(chatty_tiny_dir)))
    assert given == ModelFolder(chatty_tiny_dir, default=False) and given.ensure() == chatty_tiny_dir
    monkeypatch.setattr(pull, "ensure_default_model", lambda progress=None: pull.default_model_dir())
    default = ModelFolder.of(_args())
    assert default == ModelFolder(pull.default_model_dir(), default=True)
    assert default.ensure() == default.path  # pulled there when missing: the folder the request read
