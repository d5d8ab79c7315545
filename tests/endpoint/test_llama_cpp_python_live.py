"""`reqscope --endpoint` against llama-cpp-python's OpenAI server on the default GGUF: the strict peer.

That server's request-id middleware takes `X-Request-Id` as a UUID and answers anything else with
an empty HTTP 400, where vLLM and llama-server take any string; it answers 404 for `/version`,
`/props` and `/metrics`, so the client knows it only as an OpenAI-compatible server. It serves one
request at a time. It comes from scripts/peers/llama-cpp-python (and the GGUF from
scripts/peers/llama-server); where either is missing the module skips.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import aiohttp
import pytest
from peers import LLAMA_CPP_PYTHON_SCRIPT, LLAMA_SERVER_SCRIPT, default_gguf, llama_cpp_python, llama_cpp_python_server

from minengine.engine.request import GenerationRequest
from minengine.sampling.params import SamplingParams
from minengine.sampling.structured import StructuredOutput
from reqscope.cli import main
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.events import RequestSent, ResponseStarted, StreamEnded
from reqscope.endpoint.server.records import UNKNOWN
from reqscope.endpoint.settings import RequestSettings

if llama_cpp_python() is None:
    pytest.skip(f"llama-cpp-python's server is not provisioned: run {LLAMA_CPP_PYTHON_SCRIPT}", allow_module_level=True)
if default_gguf() is None:
    pytest.skip(f"the default GGUF is not provisioned: run {LLAMA_SERVER_SCRIPT}", allow_module_level=True)

RED = 3950  # " Red" in the default model's vocabulary
SETTINGS = RequestSettings(temperature=0.0, max_tokens=48)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


@pytest.fixture(scope="module")
def root() -> Iterator[str]:
    """The root URL of the module's llama-cpp-python server."""
    with llama_cpp_python_server() as url:
        yield url


def _events(v1: str, request: GenerationRequest, settings: RequestSettings) -> list:
    async def collect() -> list:
        async with EndpointClient(v1, poll_ms=0) as client:
            [model] = (await client.models())[:1]
            return [e async for e in client.stream_chat(request, model, settings)]

    return asyncio.run(collect())


def test_it_refuses_a_request_id_that_is_not_a_uuid(root: str) -> None:
    # The strictness the client must meet: the `req-…` form reqscope shows is refused, a UUID is not.
    async def status(request_id: str) -> tuple[int, str]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with aiohttp.ClientSession() as session:
            headers = {"X-Request-Id": request_id}
            async with session.post(root + "/v1/chat/completions", json=body, headers=headers) as response:
                return response.status, await response.text()

    assert asyncio.run(status("req-0123456789ab")) == (400, "")
    assert asyncio.run(status(str(uuid.uuid4())))[0] == 200


def test_cli_plain_streams_an_answer_with_a_uuid_request_id(root: str, capsys) -> None:
    argv = ["--base-url", root + "/v1", "--plain", "--temperature", "0", "--max-tokens", "8", "Name a color."]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip(), captured.err
    assert "HTTP 200" in captured.err
    # The server echoes the id it was sent; it is a UUID in its dashed form.
    echoed = next(line for line in captured.err.splitlines() if "x-request-id" in line).split()[-1]
    assert str(uuid.UUID(echoed)) == echoed
    assert "finish    length" in captured.err


def test_client_sends_a_uuid_and_keeps_the_requests_own_name(root: str) -> None:
    request = GenerationRequest.from_prompt("Say hello.")
    events = _events(root + "/v1", request, RequestSettings(temperature=0.0, max_tokens=4))
    sent = next(e for e in events if isinstance(e, RequestSent))
    response = next(e for e in events if isinstance(e, ResponseStarted))
    result = next(e for e in events if isinstance(e, StreamEnded)).result
    assert result.error is None and result.status == 200
    assert str(uuid.UUID(sent.request_id)) == sent.request_id == response.request_id
    assert sent.display_id == request.request_id and request.request_id.startswith("req-")
    # It sends no usage in a stream (stream_options is not read): one token a chunk, counted from the chunks.
    assert result.usage is None and result.finish_reason == "length"
    assert result.output_tokens == result.chunks == 4 and result.output_tokens_source == "chunks"
    # It answers 404 on every route that names a server: the client reads none of a server's own views.
    assert result.server_view is not None and result.server_view.kind.name == UNKNOWN


def test_json_mode_logit_bias_and_penalties_reach_it_as_openai_fields(root: str) -> None:
    structured = StructuredOutput("json_object")
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    request = GenerationRequest.from_prompt("Give a city and its population as JSON.", structured=structured,
                                            sampling=sampling)  # fmt: skip
    result = next(e for e in _events(root + "/v1", request, SETTINGS) if isinstance(e, StreamEnded)).result
    assert result.error is None, result.error
    json.loads(result.text)  # its grammar for json_object held, to the end
    sampling = SamplingParams(logit_bias=((RED, 100.0),))
    request = GenerationRequest.from_prompt("Name a color.", sampling=sampling)
    three = RequestSettings(temperature=0.0, max_tokens=3)
    result = next(e for e in _events(root + "/v1", request, three) if isinstance(e, StreamEnded)).result
    assert result.error is None and result.text == " Red Red Red"


def test_a_json_schema_in_openais_form_is_refused_with_the_servers_own_words(root: str) -> None:
    # 0.3.36 reads response_format {"type": "json_object", "schema": ...} only; OpenAI's json_schema form
    # (which vLLM and llama-server take) fails its validation, and the client passes its message on.
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA), name="city")
    request = GenerationRequest.from_prompt("Give a city and its population as JSON.", structured=structured)
    result = next(e for e in _events(root + "/v1", request, SETTINGS) if isinstance(e, StreamEnded)).result
    assert result.status == 500 and "Input should be 'text' or 'json_object'" in result.error
