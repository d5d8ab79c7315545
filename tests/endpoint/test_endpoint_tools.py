"""Tools, structured output, penalties and bias through the endpoint client, on pages a real vLLM sent.

tests/data holds what vLLM 0.32 (CPU build, `--enable-auto-tool-choice --tool-call-parser hermes`;
without a parser it refuses even a named tool choice) answered on the default model for
"What is the weather in Paris?" with one tool, `get_weather(city)`, greedy, 200 tokens at most, sent
with `return_token_ids` (so each chunk names the tokens it carries):

- vllm-tool-named-stream.json: the chunks of the request with `tool_choice` naming get_weather;
- vllm-tool-required-stream.json: the same with `tool_choice: "required"`;
- vllm-tokenize-tools.json: its `POST /tokenize` answers for the messages with the tool and without.

A few lines of aiohttp replay them at a loopback port, as vLLM's routes (`/metrics` names it vLLM), so
the whole client runs: the body it sends, the tool calls put together from the deltas, the tools'
cost counted by the server's own /tokenize, and what --plain and --json print of them.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest
from aiohttp import web
from rich.console import Console
from textual.widgets import Static
from tokenizers import Tokenizer
from ui_fixtures import wait_for

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.sampling.params import SamplingParams
from minengine.sampling.structured import StructuredOutput
from minengine.text.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, ToolChoice
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.controls import OPENAI_API, OutputControls, shape_line
from reqscope.endpoint.events import ChunkReceived, RequestSent, StreamEnded
from reqscope.endpoint.jsonl import print_endpoint_jsonl
from reqscope.endpoint.plain import print_endpoint_plain
from reqscope.endpoint.server.records import LLAMA_SERVER, VLLM, ToolsCost
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget
from reqscope.endpoint.tool_calls import ToolCallAssembler, arguments_problem, parse_tool_call_pieces
from reqscope.endpoint.trace import EndpointTraceHeader, read_endpoint_trace, write_endpoint_trace
from reqscope.endpoint.wire import parse_chunk
from reqscope.serve.runner import start_in_thread
from reqscope.ui.endpoint.app import EndpointApp

DATA = Path(__file__).resolve().parent.parent / "data"
NAMED = [json.loads(line) for line in (DATA / "vllm-tool-named-stream.json").read_text().splitlines()]
REQUIRED = [json.loads(line) for line in (DATA / "vllm-tool-required-stream.json").read_text().splitlines()]
TOKENIZE = json.loads((DATA / "vllm-tokenize-tools.json").read_text())
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = Tool("get_weather", "Current weather in a city", json.dumps(PARAMETERS))
QUESTION = "What is the weather in Paris?"


def _assembled(chunks: list[dict]):
    assembler = ToolCallAssembler()
    for chunk in chunks:
        assembler.add(parse_chunk(json.dumps(chunk)).tool_calls)
    return assembler.calls()


def _written(chunks: list[dict], model_dir: Path) -> dict:
    """The call as the model wrote it: the chunks' token ids (vLLM's return_token_ids) decoded by the
    model's own tokenizer, in the Hermes form `<tool_call>{...}</tool_call>` its parser reads."""
    ids = [i for c in chunks for choice in c.get("choices", ()) for i in choice.get("token_ids") or ()]
    text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True)
    inner = text.split(TOOL_CALL_OPEN, 1)[1].split(TOOL_CALL_CLOSE, 1)[0]
    return json.loads(inner)


@pytest.mark.parametrize(("chunks", "finish"), [(NAMED, "stop"), (REQUIRED, "tool_calls")], ids=["named", "required"])
def test_the_streamed_deltas_add_up_to_the_call_the_model_wrote(chunks, finish, default_model_dir):
    [call] = _assembled(chunks)
    written = _written(chunks, default_model_dir)
    assert call.name == written["name"] == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.arguments) == written["arguments"]
    # The name and id come once, on the first piece; every later piece is a part of the arguments only.
    pieces = [p for c in chunks for p in parse_chunk(json.dumps(c)).tool_calls]
    assert pieces[0].name == "get_weather" and all(p.name is None and p.id is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == call.arguments
    assert [parse_chunk(json.dumps(c)).finish_reason for c in chunks if parse_chunk(json.dumps(c)).finish_reason] == [
        finish
    ]
    # vLLM 0.32's grammar for a forced call (hermes's parser) let the default model write a string where
    # get_weather's schema asks for an object: the client says so rather than pass it as a call.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    assert arguments_problem(call) == "its arguments are JSON but not an object (str)"


def test_a_non_streamed_messages_tool_calls_read_as_whole_pieces():
    message = [{"id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
               {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": '{"x": 1}'}}]  # fmt: skip
    assembler = ToolCallAssembler()
    assembler.add(parse_tool_call_pieces(message))
    calls = [(c.id, c.name, c.arguments) for c in assembler.calls()]
    assert calls == [("call_1", "a", "{}"), ("call_2", "b", '{"x": 1}')]


def test_vllms_tokenize_counts_the_prompt_alike_with_and_without_the_tools():
    # The default model's template has no tool syntax: vLLM renders it without them, and says nothing.
    cost = ToolsCost(TOKENIZE["with_tools"]["count"], TOKENIZE["without_tools"]["count"], "vLLM /tokenize")
    assert TOKENIZE["with_tools"]["tokens"] == TOKENIZE["without_tools"]["tokens"]
    assert cost.dropped and cost.tokens == 0
    assert cost.line().startswith("the server's template dropped the tools")
    assert ToolsCost(120, 80, "x").line() == "tools cost 40 prompt tokens (120 with, 80 without; x)"


# -- the whole client against the replayed pages -------------------------------------------------------


@dataclass
class Replay:
    """The replaying server: its base URL and the bodies it was sent, by route."""

    v1: str
    bodies: dict[str, list[dict]] = field(default_factory=dict)


def _app(replay: Replay, chunks: list[dict]) -> web.Application:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")

    async def version(_request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smollm2", "object": "model"}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        replay.bodies.setdefault("tokenize", []).append(body)
        return web.json_response(TOKENIZE["with_tools" if body.get("tools") else "without_tools"])

    async def chat(request: web.Request) -> web.StreamResponse:
        replay.bodies.setdefault("chat", []).append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture
def replayed() -> Iterator[Replay]:
    replay = Replay("")
    server = start_in_thread(_app(replay, NAMED), "127.0.0.1", 0)
    try:
        replay.v1 = server.url + "/v1"
        yield replay
    finally:
        server.stop()


def _request(**kwargs) -> GenerationRequest:
    return GenerationRequest.from_prompt(QUESTION, tools=(WEATHER,), **kwargs)


async def _events(v1: str, request: GenerationRequest) -> list:
    async with EndpointClient(v1, poll_ms=0) as client:
        return [e async for e in client.stream_chat(request, "smollm2", RequestSettings(temperature=0.0))]


def test_the_client_sends_openai_fields_and_reads_back_the_call_and_its_cost(replayed):
    request = _request(tool_choice=ToolChoice("function", "get_weather"),
                       sampling=SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, logit_bias=((28, -5.0),)))
    events = asyncio.run(_events(replayed.v1, request))
    [body] = replayed.bodies["chat"]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": PARAMETERS}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["repetition_penalty"] == 1.1 and body["presence_penalty"] == 0.5
    assert body["logit_bias"] == {"28": -5.0}
    assert "frequency_penalty" not in body and "response_format" not in body  # not asked, not sent
    result = next(e for e in events if isinstance(e, StreamEnded)).result
    assert result.error is None
    assert result.tool_calls == _assembled(NAMED)
    # The tool call's pieces are the output: timed as chunks, so TTFT and ITL cover them.
    assert result.chunks == sum(1 for e in events if isinstance(e, ChunkReceived)) > 1
    assert result.metrics is not None and result.output_tokens == NAMED[-1]["usage"]["completion_tokens"]
    # The server's /tokenize asked twice, with the tools and without: the same count, so they were dropped.
    assert [bool(b.get("tools")) for b in replayed.bodies["tokenize"]] == [True, False]
    cost = result.server_view.tools_cost
    assert cost is not None and cost.dropped and cost.with_tools == TOKENIZE["with_tools"]["count"]


def test_plain_and_json_show_the_calls_and_that_the_template_dropped_the_tools(replayed):
    request = _request(tool_choice=ToolChoice("function", "get_weather"))

    async def printed(printer) -> tuple[str, str]:
        out, err = io.StringIO(), io.StringIO()
        async with EndpointClient(replayed.v1, poll_ms=0) as client:
            events = client.stream_chat(request, "smollm2", RequestSettings(temperature=0.0))
            if printer is print_endpoint_plain:
                await printer(events, out=out, err=err)
            else:
                await printer(events, out=out)
        return out.getvalue(), err.getvalue()

    [call] = _assembled(NAMED)
    out, err = asyncio.run(printed(print_endpoint_plain))
    assert f"[tool call 0] get_weather({call.arguments})" in out
    assert "· asked     tools get_weather, tool_choice get_weather" in err
    assert f"tool call 0  {call.id}  get_weather(" in err
    assert "! its arguments are JSON but not an object (str)" in err
    assert "tools     the server's template dropped the tools" in err
    out, _ = asyncio.run(printed(print_endpoint_jsonl))
    records = [json.loads(line) for line in out.splitlines()]
    sent, done = records[0], next(r for r in records if r["event"] == "done")
    assert sent["controls"]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert done["tool_calls"] == [{"id": call.id, "name": "get_weather", "arguments": call.arguments}]
    assert done["server_view"]["tools_cost"]["dropped"] is True
    pieces = [p for r in records if r["event"] == "chunk" for p in r.get("tool_calls", ())]
    assert "".join(p["arguments"] for p in pieces) == call.arguments


def test_the_request_id_sent_is_a_uuid_and_the_request_keeps_its_name(replayed):
    import uuid

    request = GenerationRequest.from_prompt(QUESTION)
    first = asyncio.run(_events(replayed.v1, request))
    sent = next(e for e in first if isinstance(e, RequestSent))
    assert str(uuid.UUID(sent.request_id)) == sent.request_id and sent.display_id == request.request_id
    view = next(e for e in first if isinstance(e, StreamEnded)).result.server_view
    assert view.request_id == sent.request_id and view.display_id == request.request_id


# -- what each server is known to read ----------------------------------------------------------------


def test_a_regex_goes_to_vllm_as_structured_outputs_and_is_refused_for_llama_server():
    controls = OutputControls.of(GenerationRequest.from_prompt("x", structured=StructuredOutput("regex", "[0-9]+")))
    assert controls.body_fields(VLLM) == {"structured_outputs": {"regex": "[0-9]+"}}
    with pytest.raises(ReqscopeError, match="llama-server takes no regex"):
        controls.check(LLAMA_SERVER)
    with pytest.raises(ReqscopeError, match="OpenAI's API refuses vLLM's structured_outputs.regex"):
        controls.check(OPENAI_API)


def test_a_json_schema_is_openais_response_format():
    schema = StructuredOutput("json_schema", json.dumps(PARAMETERS), name="weather")
    fields = OutputControls.of(GenerationRequest.from_prompt("x", structured=schema)).body_fields(LLAMA_SERVER)
    expected = {"type": "json_schema", "json_schema": {"name": "weather", "schema": PARAMETERS}}
    assert fields == {"response_format": expected}


def test_repetition_penalty_is_refused_for_llama_server_and_a_neutral_one_given_is_sent():
    on = OutputControls.of(GenerationRequest.from_prompt("x", sampling=SamplingParams(repetition_penalty=1.2)))
    with pytest.raises(ReqscopeError, match="llama-server has no repetition_penalty"):
        on.check(LLAMA_SERVER)
    request = GenerationRequest.from_prompt("x")
    assert OutputControls.of(request).body_fields() == {}  # nothing asked: nothing sent
    given = OutputControls.of(request, given=("frequency_penalty",))
    assert given.body_fields() == {"frequency_penalty": 0.0}  # given on purpose: overrides a server default


def test_a_forced_tool_choice_without_tools_is_refused():
    controls = OutputControls.of(GenerationRequest.from_prompt("x", tool_choice=ToolChoice("required")))
    with pytest.raises(ReqscopeError, match="--tool-choice required needs the tools"):
        controls.check(VLLM)


def test_shape_line_checks_the_text_against_what_was_asked():
    regex = StructuredOutput("regex", "[0-9]+")
    assert shape_line(regex, "123").endswith("the text matches it")
    assert shape_line(regex, "12a").endswith("the text does not match it")
    schema = StructuredOutput("json_schema", json.dumps(PARAMETERS))
    assert shape_line(schema, '{"city": "Paris"}').endswith("the text is JSON")
    assert "not JSON" in shape_line(schema, '{"city": ')


def test_an_exported_trace_keeps_the_controls_and_the_tool_calls(replayed, tmp_path):
    request = _request(tool_choice=ToolChoice("function", "get_weather"),
                       sampling=SamplingParams(logit_bias=((28, -5.0),)))  # fmt: skip
    events = asyncio.run(_events(replayed.v1, request))
    path = write_endpoint_trace(tmp_path, EndpointTraceHeader(replayed.v1, "smollm2"), events)
    _, back = read_endpoint_trace(path)
    assert back == events


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_explorer_shows_the_call_and_that_the_template_dropped_the_tools(replayed, anyio_backend):
    request = _request(tool_choice=ToolChoice("function", "get_weather"))
    # The controls as `reqscope --endpoint` builds them from the flags: a neutral penalty given on purpose is sent.
    controls = OutputControls.of(request, given=("frequency_penalty",))
    settings = RequestSettings(temperature=0.0)
    app = EndpointApp(EndpointTarget(replayed.v1), request, settings=settings, controls=controls)
    [call] = _assembled(NAMED)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.view.result is not None, timeout=60)
        await wait_for(pilot, lambda: not app.needs_repaint)
        answer = _drawn(app, "#tokens")
        assert f"tool call 0: get_weather({call.arguments})" in answer
        assert "asked: tools get_weather, tool_choice get_weather" in answer
        await pilot.press("5")  # the server's template & tokens
        await wait_for(pilot, lambda: not app.needs_repaint)
        assert "the server's template dropped the tools" in _drawn(app, "#template")
    [body] = replayed.bodies["chat"]
    assert body["frequency_penalty"] == 0.0 and body["tool_choice"]["function"]["name"] == "get_weather"


def _drawn(app: EndpointApp, selector: str) -> str:
    widget = app.screen.query_one(selector)
    console = Console(width=300, file=io.StringIO(), record=True, color_system=None)
    console.print(widget.content if isinstance(widget, Static) else widget.render())
    return console.export_text()
