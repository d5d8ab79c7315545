"""The command line as users of vLLM and llama.cpp expect it: --version, typo help, defaults shown."""

from __future__ import annotations

import argparse
import re

import pytest

from reqscope import cli
from reqscope.flag_aliases import is_alias


def test_version_names_the_installed_package(capsys):
    from importlib import metadata

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"reqscope {metadata.version('reqscope')}\n"


@pytest.mark.parametrize(("word", "verb"), [("serv", "serve"), ("plna", "plan"), ("pul", "pull"), ("benchh", "bench")])
def test_a_verb_one_edit_away_is_caught_before_any_run(capsys, word, verb):
    assert cli.main([word, "--port", "1"]) == 2
    err = capsys.readouterr().err
    hint = f"(use `reqscope run {word}` to send it as a prompt)"
    assert err == f"reqscope: error: did you mean `reqscope {verb}`? {hint}\n"


@pytest.mark.parametrize("word", ["hello", "Kyoto", "serve me", "2+2", "replayed", "runner"])
def test_prompts_that_are_not_typos_are_left_alone(word):
    assert cli.mistyped_verb(word) is None


@pytest.mark.parametrize("verb", sorted(cli.SUBCOMMANDS))
def test_help_shows_every_options_default_and_examples(verb):
    parser = cli.build_parser(verb)
    text = parser.format_help()
    assert "examples:" in text and cli.EXAMPLES[verb][0] in text
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or is_alias(action):
            continue  # an old name is hidden from help; its new one shows the default
        shown = formatter._get_help_string(action)
        assert "default" in shown, f"{verb} {action.option_strings[0]}: no default in {shown!r}"
    assert not re.search(r"default: None\b", text)


def test_vllm_names_for_dtypes_are_accepted():
    import torch

    from minengine.device import resolve_dtype
    from minengine.engine.request import GenerationRequest

    cpu = torch.device("cpu")
    assert resolve_dtype("half", cpu) == torch.float16 and resolve_dtype("float", cpu) == torch.float32
    assert GenerationRequest.from_prompt("hi", kv_dtype="fp8").kv_dtype == "float8_e4m3fn"
    run = cli.build_parser("run").parse_args(["--kv-cache-dtype", "fp8", "--dtype", "half", "hi"])
    assert (run.kv_cache_dtype, run.dtype) == ("fp8", "half")
    plan = cli.build_parser("plan").parse_args(["smollm2-135m-instruct", "--kv-cache-dtype", "float8_e4m3fn"])
    assert plan.kv_cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("argv", "spins"),
    [
        ([], True),  # the explorer on the default prompt
        (["Show me hotels in Kyoto"], True),
        (["run", "--plain", "hi"], True),
        (["calibrate", "--json"], True),  # its fit must describe the steps `run` takes
        (["serve"], True),  # every request's steps on one thread: one team to keep spinning
        (["bench"], False),
        (["web"], False),  # the server only relays screens...
        (["web", "--session", "--model", "m"], True),  # ...each tab's explorer decodes in its own process
        (["plan"], False),
    ],
)
def test_only_verbs_that_decode_here_let_openmp_spin(argv, spins):
    assert cli.decodes_requests(argv) is spins
