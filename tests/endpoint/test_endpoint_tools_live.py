"""Tools, structured output, penalties and bias through the endpoint client against real servers.

vLLM is the session's (tests/endpoint/conftest.py: hermes's tool parser, auto tool choice); llama-server
is this module's own, on the default GGUF. Each part skips where its peer is not provisioned
(scripts/peers/vllm, scripts/peers/llama-server). The default model's template has no tool syntax:
both vLLM and llama-server render the prompt without the tools and say nothing; the client finds it out
by counting the prompt both ways with the server's own routes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
from peers import default_gguf, llama_server, llama_server_binary, vllm_python

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.sampling.params import SamplingParams
from minengine.sampling.structured import StructuredOutput
from minengine.text.tools import Tool, ToolChoice
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.events import StreamEnded
from reqscope.endpoint.settings import RequestSettings

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = Tool("get_weather", "Current weather in a city", json.dumps(PARAMETERS))
QUESTION = "What is the weather in Paris?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
RED = 3950  # " Red" in the default model's vocabulary

needs_vllm = pytest.mark.skipif(vllm_python() is None, reason="vLLM is not provisioned: run scripts/peers/vllm")
needs_llama = pytest.mark.skipif(
    llama_server_binary() is None or default_gguf() is None,
    reason="llama-server or the default GGUF not provisioned: run scripts/peers/llama-server",
)


def _result(v1: str, request: GenerationRequest, max_tokens: int = 40):
    async def run():
        async with EndpointClient(v1, poll_ms=0) as client:
            [model] = (await client.models())[:1]
            settings = RequestSettings(temperature=0.0, max_tokens=max_tokens)
            events = [e async for e in client.stream_chat(request, model, settings)]
        return next(e for e in events if isinstance(e, StreamEnded)).result

    return asyncio.run(run())


@pytest.fixture(scope="module")
def llama_v1() -> Iterator[str]:
    with llama_server("--jinja") as root:
        yield root + "/v1"


# -- vLLM ------------------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("choice", [ToolChoice("function", "get_weather"), ToolChoice("required")],
                         ids=["named", "required"])  # fmt: skip
def test_vllm_streams_a_forced_call_that_fits_the_schema_and_drops_the_tools_from_the_template(vllm_server, choice):
    result = _result(vllm_server.v1, GenerationRequest.from_prompt(QUESTION, tools=(WEATHER,), tool_choice=choice))
    assert result.error is None, result.error
    [call] = result.tool_calls
    assert call.name == "get_weather" and call.id
    # Whole JSON; vLLM 0.32's grammar (hermes's parser) let the default model write `"Paris"` here, not the
    # object get_weather's schema asks for (tests/endpoint/test_endpoint_tools.py replays such a stream).
    json.loads(call.arguments)
    cost = result.server_view.tools_cost
    assert cost is not None and cost.dropped, cost  # the default template has no tool syntax


@needs_vllm
def test_vllm_follows_a_json_schema_a_regex_and_a_choice(vllm_server):
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA), name="city")
    result = _result(vllm_server.v1, GenerationRequest.from_prompt("A city and its population, as JSON.",
                                                                   structured=schema), max_tokens=60)  # fmt: skip
    assert result.error is None and result.finish_reason == "stop", (result.error, result.text)
    jsonschema.validate(json.loads(result.text), SCHEMA)
    regex = StructuredOutput("regex", "[0-9]{3}-[0-9]{4}")
    result = _result(vllm_server.v1, GenerationRequest.from_prompt("A phone number:", structured=regex))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", result.text), result.text
    choice = StructuredOutput("choice", choices=("red", "green", "blue"))
    result = _result(vllm_server.v1, GenerationRequest.from_prompt("Pick a color.", structured=choice))
    assert result.error is None and result.text in ("red", "green", "blue"), result.text


@needs_vllm
def test_vllm_applies_logit_bias_and_takes_the_penalties(vllm_server):
    sampling = SamplingParams(logit_bias=((RED, 100.0),))
    result = _result(vllm_server.v1, GenerationRequest.from_prompt("Name a color.", sampling=sampling), max_tokens=3)
    assert result.error is None and result.text == " Red Red Red"
    sampling = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)
    result = _result(vllm_server.v1, GenerationRequest.from_prompt("Name a color.", sampling=sampling), max_tokens=4)
    assert result.error is None and result.usage.completion_tokens >= 1


# -- llama-server ----------------------------------------------------------------------------------------


@needs_llama
def test_llama_server_drops_the_tools_from_the_default_template_and_the_client_says_so(llama_v1):
    # llama.cpp's jinja engine (the sdist's vendored build) renders the default template as it is: without
    # the tools, and it enforces no call for tool_choice "required" either. Both counts agree with the
    # usage the request itself reports, so the drop is the server's, not the client's counting.
    request = GenerationRequest.from_prompt(QUESTION, tools=(WEATHER,), tool_choice=ToolChoice("required"))
    result = _result(llama_v1, request, max_tokens=8)
    assert result.error is None, result.error
    cost = result.server_view.tools_cost
    assert cost is not None and cost.dropped, cost
    assert len(result.server_view.prompt.token_ids) == cost.with_tools == result.usage.prompt_tokens
    assert result.tool_calls == () and result.finish_reason == "length" and result.text


@needs_llama
def test_llama_server_follows_a_json_schema_and_a_regex_is_refused_before_sending(llama_v1):
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA), name="city")
    result = _result(llama_v1, GenerationRequest.from_prompt("A city and its population, as JSON.",
                                                             structured=schema), max_tokens=60)  # fmt: skip
    assert result.error is None, result.error
    jsonschema.validate(json.loads(result.text), SCHEMA)
    with pytest.raises(ReqscopeError, match="llama-server takes no regex"):
        _result(llama_v1, GenerationRequest.from_prompt("x", structured=StructuredOutput("regex", "[0-9]+")))


@needs_llama
def test_llama_server_applies_logit_bias(llama_v1):
    sampling = SamplingParams(logit_bias=((RED, 100.0),), frequency_penalty=0.0)
    result = _result(llama_v1, GenerationRequest.from_prompt("Name a color.", sampling=sampling), max_tokens=3)
    assert result.error is None and result.text == " Red Red Red", result.text
