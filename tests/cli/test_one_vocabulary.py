"""One name per idea across the verbs, vLLM's where vLLM has one; the old names still work for a release.

Each old name parses to the same value as its new one, is hidden from --help, and says once on
stderr `reqscope: --old is deprecated; use --new`. Defaults are written one way, `(default: X)`,
and the --weights help is one line, defined once.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from reqscope import cli
from reqscope.commands.web import run_flags
from reqscope.flag_aliases import deprecated_alias, is_alias


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every verb's parser, and `bench serve`'s."""
    parsers = {verb: cli.build_parser(verb) for verb in cli.SUBCOMMANDS}
    modes = next(a for a in parsers["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    parsers["bench serve"] = modes.choices["serve"]
    return parsers


def _flags(parser: argparse.ArgumentParser, aliases: bool = False) -> set[str]:
    return {s for a in parser._actions if is_alias(a) == aliases for s in a.option_strings}


# (verb, old words, new words, the destination both set): every rename of the one-vocabulary pass.
RENAMES = [
    ("run", ["--endpoint", "http://127.0.0.1:8000/v1"], ["--base-url", "http://127.0.0.1:8000/v1"], "base_url"),
    ("run", ["--config", "llama-3.1-8b"], ["--card", "llama-3.1-8b"], "card"),
    ("run", ["--kv-dtype", "fp8"], ["--kv-cache-dtype", "fp8"], "kv_cache_dtype"),
    ("run", ["--no-prefix-cache"], ["--no-enable-prefix-caching"], "prefix_cache"),
    ("web", ["--no-prefix-cache"], ["--no-enable-prefix-caching"], "prefix_cache"),
    ("serve", ["--no-prefix-cache"], ["--no-enable-prefix-caching"], "prefix_cache"),
    ("serve", ["--default-max-tokens", "64"], ["--max-tokens", "64"], "max_tokens"),
    ("bench", ["--new-tokens", "32"], ["--output-len", "32"], "output_len"),
    ("bench", ["--long-prompt-tokens", "512"], ["--long-input-len", "512"], "long_input_len"),
    ("plan", ["--kv-dtype", "float8_e4m3fn"], ["--kv-cache-dtype", "float8_e4m3fn"], "kv_cache_dtype"),
    ("plan", ["--prompt-tokens", "6000"], ["--input-len", "6000"], "input_len"),
    ("plan", ["--output-tokens", "400"], ["--output-len", "400"], "output_len"),
    ("metrics", ["--output-tokens", "150"], ["--output-len", "150"], "output_len"),
    ("metrics", ["--input-tokens", "100"], ["--input-len", "100"], "input_len"),
]


@pytest.mark.parametrize(("verb", "old", "new", "dest"), RENAMES, ids=[f"{v} {o[0]}" for v, o, _, _ in RENAMES])
def test_an_old_name_gives_the_new_ones_value_and_says_so_once(capsys, verb, old, new, dest):
    given_new = vars(cli.build_parser(verb).parse_args(new))
    assert capsys.readouterr().err == ""
    given_old = vars(cli.build_parser(verb).parse_args(old + old))  # twice: still one line
    assert capsys.readouterr().err == f"reqscope: {old[0]} is deprecated; use {new[0]}\n"
    assert given_old == given_new and dest in given_new
    assert given_new[dest] not in (None, argparse.SUPPRESS)


@pytest.mark.parametrize("verb", sorted({v for v, *_ in RENAMES}))
def test_old_names_are_hidden_from_help_and_the_usage_line(verb):
    parser = cli.build_parser(verb)
    old = {o[0] for v, o, _, _ in RENAMES if v == verb}
    assert old <= _flags(parser, aliases=True)
    text = parser.format_help()
    assert not [name for name in old if re.search(re.escape(name) + r"\b(?!-)", text)], text


def test_no_verb_keeps_an_old_name_as_a_flag_of_its_own():
    old = {o[0] for _, o, _, _ in RENAMES} - {"--endpoint"}  # bench serve's --endpoint is a route, as vLLM's
    for name, parser in _parsers().items():
        assert not old & _flags(parser), f"{name} still has {old & _flags(parser)} as flags"
    assert "--endpoint" in _flags(_parsers()["bench serve"]) and "--endpoint" not in _flags(cli.build_parser("run"))


def test_the_output_limit_has_one_name_per_quantity():
    """A request's limit is --max-tokens (vLLM's clients'), a benchmark's or the planner's length --output-len
    (`vllm bench`'s); no verb shows another name for either."""
    limits = {"--max-tokens", "--output-len"}
    others = {"--default-max-tokens", "--new-tokens", "--output-tokens", "--max-new-tokens", "--random-output-len"}
    for name, parser in _parsers().items():
        shown = _flags(parser)
        assert not (others - {"--random-output-len"}) & shown, name
    parsers = _parsers()
    assert {name for name, p in parsers.items() if limits & _flags(p)} == {
        "run", "web", "serve", "bench", "bench serve", "plan", "metrics"
    }  # fmt: skip
    assert "--random-output-len" in _flags(parsers["bench serve"])  # vLLM's own second name, kept as vLLM has it


@pytest.mark.parametrize("name", sorted(_parsers()))
def test_defaults_are_written_one_way(name):
    parser = _parsers()[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or is_alias(action):
            continue
        shown = formatter._get_help_string(action) % {"default": action.default}
        flag = action.option_strings[0]
        assert shown.count("(default: ") == 1, f"{name} {flag}: {shown!r}"
        assert not re.search(r"\(default [^:]|[;,] default\b|the default:", shown), f"{name} {flag}: {shown!r}"


def test_the_weights_help_is_one_short_line_defined_once():
    helps = {
        name: next(a.help for a in parser._actions if "--weights" in a.option_strings)
        for name, parser in _parsers().items()
        if "--weights" in _flags(parser)
    }
    assert set(helps) == {"run", "web", "serve", "bench", "calibrate"}
    assert len(set(helps.values())) == 1 and len(next(iter(helps.values()))) < 200


def test_a_plan_with_old_names_prints_what_the_new_names_print(capsys):
    new = ["plan", "llama-3.1-8b", "--input-len", "6000", "--output-len", "400", "--kv-cache-dtype", "fp8", "--json"]
    old = ["plan", "llama-3.1-8b", "--prompt-tokens", "6000", "--output-tokens", "400", "--kv-dtype", "fp8", "--json"]
    assert cli.main(new) == 0
    by_new = capsys.readouterr()
    assert cli.main(old) == 0
    by_old = capsys.readouterr()
    assert json.loads(by_old.out) == json.loads(by_new.out) and by_new.err == ""
    planned = json.loads(by_new.out)
    assert (planned["kv_dtype"], planned["stop_kv_tokens"]) == ("fp8", 6000 + 400 - 1)
    assert by_old.err.splitlines() == [
        "reqscope: --prompt-tokens is deprecated; use --input-len",
        "reqscope: --output-tokens is deprecated; use --output-len",
        "reqscope: --kv-dtype is deprecated; use --kv-cache-dtype",
    ]


def test_web_hands_its_sessions_the_new_names(capsys):
    args = cli.build_parser("web").parse_args(["--kv-dtype", "fp8", "--no-prefix-cache"])
    capsys.readouterr()
    words = run_flags(args)
    assert words == ["--kv-cache-dtype", "fp8", "--no-enable-prefix-caching"]


def test_an_alias_needs_its_flag_first():
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="--new is not a flag of this parser"):
        deprecated_alias(parser, "--old", "--new")
