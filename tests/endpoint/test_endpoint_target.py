"""The endpoint flags read into one EndpointTarget, the same for the plain modes and the explorer."""

from __future__ import annotations

from reqscope.cli import build_parser
from reqscope.endpoint.client import DEFAULT_TOP_LOGPROBS
from reqscope.endpoint.options import API_KEY_ENV
from reqscope.endpoint.target import EndpointTarget


def target_of(*argv: str) -> EndpointTarget:
    return EndpointTarget.from_args(build_parser("run").parse_args([*argv, "hi"]))


def test_the_flags_name_the_target(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    target = target_of("--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--new-connection")
    assert target == EndpointTarget("http://127.0.0.1:9/v1", api_key=None, model="m", new_connection=True)
    assert target.top_logprobs == DEFAULT_TOP_LOGPROBS
    assert target_of("--endpoint", "http://127.0.0.1:9/v1").model is None  # the server's first model


def test_the_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert target_of("--endpoint", "http://127.0.0.1:9/v1").api_key == "from-env"
    assert target_of("--endpoint", "http://127.0.0.1:9/v1", "--api-key", "flag").api_key == "flag"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert target_of("--endpoint", "http://127.0.0.1:9/v1").api_key is None  # an empty key sends no header


def test_the_client_is_built_from_the_target():
    client = EndpointTarget("http://127.0.0.1:9/v1/", api_key="k", new_connection=True, top_logprobs=3).client()
    assert (client.base_url, client.api_key, client.new_connection, client.top_logprobs) == (
        "http://127.0.0.1:9/v1", "k", True, 3,
    )
