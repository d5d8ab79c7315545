"""vLLM's request extras over HTTP: the honoured ones, and every other field refused by name."""

from __future__ import annotations

import pytest
from serve_harness import authorized, chat_body, engine_result, raw_request

from minengine.engine.request import GenerationRequest
from minengine.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0)
CHAT = "/v1/chat/completions"


def post(served, body: dict, path: str = CHAT):
    return raw_request(served.url, "POST", path, body, authorized())


def test_stop_token_ids_end_with_finish_stop(served, engine):
    reference = engine_result(engine, GenerationRequest.from_prompt("Hello there", sampling=GREEDY, max_tokens=8))
    tokens = reference.token_ids
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    resp = post(served, chat_body(max_tokens=8, temperature=0, stop_token_ids=[tokens[k]]))
    assert resp.status == 200, resp.body
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == k + 1


def test_ignore_eos_and_min_tokens_are_accepted(served):
    resp = post(served, {"model": "chatty", "prompt": "Once", "max_tokens": 5, "ignore_eos": True, "min_tokens": 5},
                "/v1/completions")  # fmt: skip
    assert resp.status == 200, resp.body
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"best_of": 2}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),  # vLLM's range is (0, 2]
        ({"top_a": 0.2}, "top_a"),
        ({"frobnicate": 1}, "frobnicate"),  # a field no server has
        ({"prompt": "hi"}, "prompt"),  # /v1/completions' field, sent to chat
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [1, "two"]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [49152]}, "stop_token_ids[0]"),  # the chatty model's vocabulary is 49152
    ],
)
def test_unsupported_or_invalid_fields_are_400_naming_the_field(served, changes, param):
    resp = post(served, {**chat_body(max_tokens=4), **changes})
    assert resp.status == 400, resp.body
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split("[")[0] in error["message"] and "\n" not in error["message"]


def test_neutral_values_and_harmless_fields_are_accepted(served):
    neutral = {"best_of": 1, "use_beam_search": False, "skip_special_tokens": True, "repetition_penalty": 1.0,
               "bad_words": [], "user": "someone", "metadata": {"team": "a"}, "priority": 0}  # fmt: skip
    resp = post(served, {**chat_body(max_tokens=2, temperature=0), **neutral})
    assert resp.status == 200, resp.body


def test_an_unknown_field_name_is_not_echoed_in_full(served):
    resp = post(served, {**chat_body(max_tokens=2), "k" * 10_000: 1})
    assert resp.status == 400 and len(resp.body) < 600
    assert resp.json()["error"]["param"].startswith("'kkk")
