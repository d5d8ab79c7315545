"""The endpoint flags read into one EndpointTarget and one RequestSettings, for every endpoint mode."""

from __future__ import annotations

import pytest

from minengine.settings import CLIENT_API_KEY_ENV as API_KEY_ENV
from reqscope.cli import build_parser, main
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.run_options import DEFAULT_PROMPT, LOCAL_SAMPLING, ModelFolder, request_from_args


def args_of(*argv: str):
    return build_parser("run").parse_args([*argv, "hi"])


def target_of(*argv: str) -> EndpointTarget:
    return EndpointTarget.from_args(args_of(*argv))


def test_the_flags_name_the_target(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    target = target_of("--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--new-connection")
    assert target == EndpointTarget("http://127.0.0.1:9/v1", api_key=None, model="m", new_connection=True)
    assert target_of("--base-url", "http://127.0.0.1:9/v1").model is None  # the server's first model


def test_a_bare_server_address_gets_openais_v1_as_bench_serve_takes_it(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert target_of("--base-url", "http://127.0.0.1:9").url == "http://127.0.0.1:9/v1"
    assert target_of("--base-url", "http://127.0.0.1:9/").url == "http://127.0.0.1:9/v1"
    assert target_of("--base-url", "http://127.0.0.1:9/v1/").url == "http://127.0.0.1:9/v1"
    assert target_of("--base-url", "http://host/openai/v1").url == "http://host/openai/v1"  # a path: as given


def test_the_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert target_of("--base-url", "http://127.0.0.1:9/v1").api_key == "from-env"
    assert target_of("--base-url", "http://127.0.0.1:9/v1", "--api-key", "flag").api_key == "flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert target_of("--base-url", "http://127.0.0.1:9/v1").api_key is None  # an empty key sends no header


def test_the_client_is_built_from_the_target():
    client = EndpointTarget("http://127.0.0.1:9/v1/", api_key="k", new_connection=True).client()
    assert (client.base_url, client.api_key, client.new_connection) == ("http://127.0.0.1:9/v1", "k", True)


def test_settings_hold_only_the_flags_given_and_no_logprobs_by_default():
    assert RequestSettings.from_args(args_of("--base-url", "http://127.0.0.1:9/v1")) == RequestSettings()
    given = RequestSettings.from_args(args_of("--temperature", "0", "--top-k", "0", "--seed", "7", "--max-tokens", "9"))
    assert given == RequestSettings(temperature=0.0, top_k=0, seed=7, max_tokens=9)
    assert given.server_default() == ("top_p", "min_p")
    assert RequestSettings.from_args(args_of("--logprobs", "3")).top_logprobs == 3
    assert RequestSettings.from_args(args_of("--logprobs", "0")).top_logprobs == 0  # the chosen token's only
    assert RequestSettings.from_args(args_of("--logprobs", "3", "--no-logprobs")).top_logprobs is None


def test_a_local_run_still_fills_in_its_own_defaults():
    request = request_from_args(args := args_of(), DEFAULT_PROMPT, ModelFolder.of(args))
    s, d = request.sampling, LOCAL_SAMPLING
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (d.temperature, d.top_k, d.top_p, d.min_p, d.seed)
    assert request.max_tokens == d.max_tokens == 256 and s.temperature == 0.7 and s.seed == 0
    args = args_of("--temperature", "0", "--top-k", "0", "--max-tokens", "5")
    given = request_from_args(args, DEFAULT_PROMPT, ModelFolder.of(args))
    assert (given.sampling.temperature, given.sampling.top_k, given.max_tokens) == (0.0, 0, 5)


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_logprobs_count_is_one_line_and_exit_2(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--base-url", "http://127.0.0.1:9/v1", f"--logprobs={value}", "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("reqscope: error: argument --logprobs: ")
    assert err.count("\n") == 1 and "Traceback" not in err
