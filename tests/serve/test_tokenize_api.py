"""vLLM's `POST /tokenize` and `/detokenize` on `reqscope serve`: the shapes vLLM answers, the
tokens transformers' tokenizer and chat template give, and the very prompt the engine runs
(tools in reqscope's generic block included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_harness import MODEL, authorized, chat_body, raw_request
from transformers import AutoTokenizer

from minengine.engine.events import PromptEvent
from minengine.engine.request import GenerationRequest
from minengine.text.chat_template import Message
from minengine.text.tools import Tool

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOOLS = json.loads((EXAMPLES / "search_hotels.json").read_text())
KYOTO = "Show me wheelchair-accessible hotels in Kyoto"
CHAT = [{"role": "system", "content": "You plan trips."}, {"role": "user", "content": KYOTO}]


@pytest.fixture(scope="module")
def reference(chatty_tiny_dir):
    """transformers' tokenizer over the same files (the default model's tokenizer and template)."""
    return AutoTokenizer.from_pretrained(chatty_tiny_dir)


def post(served, path: str, body: dict):
    return raw_request(served.url, "POST", path, body, authorized())


def engine_prompt_ids(engine, request: GenerationRequest) -> list[int]:
    """The prompt the engine runs for `request` (its PromptEvent), stopping before any decode."""
    for event in engine.generate(request.with_(max_tokens=1)):
        if isinstance(event, PromptEvent):
            return [p.token_id for p in event.pieces]
    raise AssertionError("no prompt event")


def test_prompt_is_tokenized_as_is(served, reference):
    resp = post(served, "/tokenize", {"model": MODEL, "prompt": "Kyoto <|im_end|> hotels"})
    assert resp.status == 200, resp.body
    body = resp.json()
    expected = reference("Kyoto <|im_end|> hotels", add_special_tokens=False)["input_ids"]
    assert body == {"count": len(expected), "max_model_len": 2048, "tokens": expected, "token_strs": None}


def test_messages_go_through_the_chat_template(served, reference):
    body = post(served, "/tokenize", {"model": MODEL, "messages": CHAT, "return_token_strs": True}).json()
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert body["tokens"] == expected["input_ids"] and body["count"] == len(expected["input_ids"])
    assert body["token_strs"] == reference.convert_ids_to_tokens(expected["input_ids"])
    without = post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()  # model optional
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True, return_dict=True)
    assert without["tokens"] == expected["input_ids"]


def test_counts_match_the_prompt_a_chat_request_runs(served, engine):
    """With tools, the tokens are the engine's own prompt (reqscope's tool block included), and
    the count is the usage a chat completion with the same messages and tools reports."""
    body = post(served, "/tokenize", {"model": MODEL, "messages": CHAT, "tools": TOOLS}).json()
    plain = post(served, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    tools = tuple(Tool(t["function"]["name"], t["function"]["description"], json.dumps(t["function"]["parameters"]))
                  for t in TOOLS)  # fmt: skip
    messages = tuple(Message(m["role"], m["content"]) for m in CHAT)
    assert body["tokens"] == engine_prompt_ids(engine, GenerationRequest(messages=messages, tools=tools))
    assert body["count"] > plain["count"] + 100  # the tools cost prompt tokens
    completion = post(served, "/v1/chat/completions", {**chat_body(max_tokens=1), "messages": CHAT, "tools": TOOLS})
    assert completion.status == 200, completion.body
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]


def test_detokenize_gives_the_text_back(served, reference):
    ids = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    resp = post(served, "/detokenize", {"model": MODEL, "tokens": ids})
    assert resp.status == 200, resp.body
    assert resp.json() == {"prompt": reference.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": []}, "messages"),
        ("/tokenize", {"model": MODEL, "messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ("/tokenize", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {}}]},
         "tools[0].function.name"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "frobnicate": 1}, "frobnicate"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 49152]}, "tokens[1]"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"model": MODEL, "tokens": "1 2"}, "tokens"),
    ],
)  # fmt: skip
def test_bad_bodies_are_400_naming_the_field(served, path, body, param):
    resp = post(served, path, body)
    assert resp.status == 400, resp.body
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"]


def test_another_model_is_404_and_a_key_is_required(served):
    other = post(served, "/tokenize", {"model": "gpt-9", "prompt": "a"})
    assert other.status == 404 and other.json()["error"]["code"] == "model_not_found"
    keyless = raw_request(served.url, "POST", "/detokenize", {"tokens": [1]})
    assert keyless.status == 401
