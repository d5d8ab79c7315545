"""The engine names settings, the app words them: one table, every setting in it, each word real."""

from __future__ import annotations

import dataclasses

import pytest

from minengine.engine.events import DoneEvent, PrefixCacheEvent, StageEvent
from minengine.errors import AdmissionError, EngineText, Mention, ReqscopeError, Setting
from reqscope.cli import SUBCOMMANDS, build_parser
from reqscope.ui.keys import KEYS
from reqscope.wording import WORDS, error_text, in_app_words, worded


def _options(verb: str) -> set[str]:
    return {opt for action in build_parser(verb)._actions for opt in action.option_strings}


def test_every_setting_has_its_words():
    assert set(WORDS) == set(Setting)


@pytest.mark.parametrize("setting", list(Setting), ids=lambda s: s.name)
def test_each_word_is_a_flag_a_verb_or_a_key_the_app_has(setting):
    words = WORDS[setting]
    said = words.said.split()
    if said[0] == "reqscope":  # a command: its verb, then flags that verb takes
        verb, flags = said[1], said[2:]
        assert verb in SUBCOMMANDS
    else:
        verb, flags = None, said[:1]
    every_flag = set().union(*(_options(v) for v in SUBCOMMANDS)) if verb is None else _options(verb)
    assert all(flag in every_flag for flag in flags), f"{setting}: {words.said}"
    if words.key:
        assert any(words.key in key.keys.split(",") and key.action == "export" for key in KEYS)


def test_an_engine_error_reads_in_the_engines_words_and_shows_in_the_apps():
    exc = AdmissionError("needs 9 MiB of KV; lower ", Setting.MAX_TOKENS, " or raise ", Setting.KV_BUDGET)
    assert str(exc) == "needs 9 MiB of KV; lower max_tokens or raise kv_budget_bytes"
    assert error_text(exc) == "needs 9 MiB of KV; lower --max-tokens or raise --kv-budget-mib"
    assert error_text(ValueError("plain")) == "plain" and error_text(ReqscopeError("no settings")) == "no settings"


def test_a_mention_says_its_value_or_every_way_to_give_it():
    message = EngineText(
        Mention(Setting.DEVICE, "cuda"), "; pass ", Mention(Setting.MODEL_DIR, every_way=True),
        "; export with ", Mention(Setting.EXPORT_DIR, every_way=True),
    )  # fmt: skip
    assert worded(message) == "--device cuda; pass --model PATH; export with --export DIR or the x key"
    assert EngineText("wrapped: ", message).parts[1:] == message.parts  # a message inside another keeps its settings


def test_the_events_leave_the_engine_in_the_apps_words(chatty_engine):
    from minengine.engine.request import GenerationRequest
    from minengine.sampling.params import SamplingParams

    request = GenerationRequest.from_prompt("hi", sampling=SamplingParams(temperature=0.0), max_tokens=2)
    events = list(chatty_engine.start(request))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    note = EngineText("off (", Setting.PREFIX_CACHE_OFF, ")")
    off = PrefixCacheEvent(False, 4, 16, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, note=note)
    error = EngineText("lower ", Setting.MAX_TOKENS)
    failed = DoneEvent(dataclasses.replace(done.result, error=error, prefix_cache=off))
    stage = next(e for e in events if isinstance(e, StageEvent))
    out = list(in_app_words([stage, off, failed]))
    assert out[0] is stage  # events without engine text pass as they are
    assert out[1].note == "off (--no-enable-prefix-caching)" and not isinstance(out[1].note, EngineText)
    assert out[2].result.error == "lower --max-tokens"
    assert out[2].result.prefix_cache.note == "off (--no-enable-prefix-caching)"
    assert list(in_app_words([done]))[0] is done  # a result with nothing to word passes as it is
