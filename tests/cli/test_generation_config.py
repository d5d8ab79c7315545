"""Sampling defaults from the model folder's generation_config.json, as vLLM and transformers take them."""

from __future__ import annotations

import json
import shutil

import pytest

from minengine.engine.request import SettingSource
from minengine.errors import ConfigError
from minengine.sampling.model_defaults import ModelSamplingDefaults
from minengine.sampling.params import SamplingParams
from reqscope import cli
from reqscope.run_options import LOCAL_SAMPLING, ModelFolder, request_from_args
from reqscope.ui.run.status_line import settings_note


@pytest.fixture
def folder(chatty_tiny_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(chatty_tiny_dir, copy)
    return copy


def _generation_config(folder, **fields):
    path = folder / "generation_config.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    raw.update(fields)
    path.write_text(json.dumps(raw))
    return path


def _request(folder, *flags):
    args = cli.build_parser("run").parse_args(["--model", str(folder), *flags, "hi"])
    return request_from_args(args, "hi", ModelFolder.of(args))


def test_unset_flags_take_the_models_values_and_say_so(folder):
    _generation_config(folder, temperature=0.6, top_p=0.95, max_new_tokens=77, do_sample=True)
    request = _request(folder, "--top-k", "5")
    s = request.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, request.max_tokens) == (0.6, 5, 0.95, LOCAL_SAMPLING.min_p, 77)
    assert request.setting_sources == (
        SettingSource("temperature", "generation_config.json"),
        SettingSource("top_k", "flag"),
        SettingSource("top_p", "generation_config.json"),
        SettingSource("min_p", "reqscope default"),
        SettingSource("seed", "reqscope default"),
        SettingSource("max_tokens", "generation_config.json"),
    )
    assert settings_note(request, s) == "model: T p max · set: k · default: min-p seed"
    assert settings_note(request, SamplingParams(temperature=0)) == "set in the explorer"


def test_generation_config_reqscope_ignores_the_file(folder):
    _generation_config(folder, temperature=0.1, repetition_penalty=1.3)  # not even read
    request = _request(folder, "--generation-config", "reqscope")
    assert request.sampling.temperature == LOCAL_SAMPLING.temperature
    assert {s.source for s in request.setting_sources} == {"reqscope default"}


def test_a_folder_without_sampling_values_keeps_reqscopes_defaults(folder):
    request = _request(folder)  # the tiny model's file holds only token ids
    assert (request.sampling.temperature, request.sampling.top_k) == (LOCAL_SAMPLING.temperature, LOCAL_SAMPLING.top_k)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"repetition_penalty": 1.05}, "sets repetition_penalty 1.05, which reqscope's sampler does not apply"),
     ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
     ({"temperature": "hot"}, "temperature must be a number"),
     ({"top_p": 1.5}, "top_p must be between 0 and 1"),
     ({"max_new_tokens": 0}, "max_new_tokens must be a whole number >= 1")],
)  # fmt: skip
def test_values_it_cannot_honour_are_refused_by_name(folder, fields, needle):
    path = _generation_config(folder, **fields)
    with pytest.raises(ConfigError, match=needle) as info:
        ModelSamplingDefaults.read(folder)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_neutral_values_of_unapplied_fields_are_fine(folder):
    _generation_config(folder, repetition_penalty=1.0, num_beams=1, temperature=0.3)
    assert ModelSamplingDefaults.read(folder).temperature == 0.3


def test_the_run_applies_them_end_to_end(folder, capsys):
    _generation_config(folder, temperature=0.0)  # greedy, from the model's file
    assert cli.main(["--json", "--model", str(folder), "--max-tokens", "2", "hi"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["event"] == "request"
    assert first["settings"]["temperature"] == {"value": 0.0, "source": "generation_config.json"}
    assert first["settings"]["max_tokens"] == {"value": 2, "source": "flag"}
    _generation_config(folder, repetition_penalty=1.2)
    assert cli.main(["--plain", "--model", str(folder), "--max-tokens", "2", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--generation-config reqscope" in err
    argv = ["--plain", "--model", str(folder), "--max-tokens", "2", "--generation-config", "reqscope", "hi"]
    assert cli.main(argv) == 0
    assert "· settings  temperature 0.7 (reqscope default)" in capsys.readouterr().err
