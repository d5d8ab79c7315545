"""The engine's messages in the app's words: each engine setting a message names becomes its flag or key.

minengine names what to change by its own `Setting` ("lower max_tokens"); the user changes it
with a flag, a key in the explorer or a command, so the app says that ("lower --max-tokens").
`WORDS` is the one table; `error_text` words an error wherever the app shows one (the CLI's line,
the `--plain`/`--json` records, the explorers, serve's JSON errors), and `in_app_words` (one at
a time: `in_app_event`) words the texts the engine's events carry (a result's error, the prefix
cache's note) as they leave it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from minengine.errors import EngineText, Mention, Setting

if TYPE_CHECKING:
    from minengine.engine.events import Event, PrefixCacheEvent, RequestResult


@dataclass(frozen=True)
class Words:
    """How a user of the app gives one engine setting."""

    said: str  # the flag (or the command) that sets it
    placeholder: str = ""  # what follows the flag when no value is named ("PATH")
    key: str = ""  # the explorer's key that does it, if one does


WORDS: dict[Setting, Words] = {
    Setting.MODEL_DIR: Words("--model", placeholder="PATH"),
    Setting.DEVICE: Words("--device"),
    Setting.DTYPE: Words("--dtype"),
    Setting.WEIGHTS: Words("--weights"),
    Setting.MAX_TOKENS: Words("--max-tokens"),
    Setting.KV_BUDGET: Words("--kv-budget-mib"),
    Setting.PREFIX_CACHE_OFF: Words("--no-enable-prefix-caching"),
    Setting.BLOCK_SIZE: Words("--block-size"),
    Setting.MODEL_SAMPLING_DEFAULTS_OFF: Words("--generation-config reqscope"),
    Setting.EXPORT_DIR: Words("--export", placeholder="DIR", key="x"),
    Setting.EXPORT_REPLACES: Words("--force"),
    Setting.CALIBRATION_REPEATS: Words("--repeats"),
    Setting.CALIBRATION_DECODE_STEPS: Words("--decode-steps"),
    Setting.CALIBRATION_PROMPT_LENGTHS: Words("--prompt-lengths"),
    Setting.CALIBRATION_CONTEXT_LENGTHS: Words("--context-lengths"),
    Setting.CALIBRATION_SAVED: Words("reqscope calibrate --output"),
    Setting.GGUF_IMPORT: Words("reqscope import"),
    Setting.PLANNER: Words("reqscope plan"),
    Setting.MAX_NUM_SEQS: Words("--max-num-seqs"),
    Setting.MAX_NUM_BATCHED_TOKENS: Words("--max-num-batched-tokens"),
    Setting.KERNELS: Words("--kernels"),
    Setting.CHAT_TEMPLATE_FILE: Words("--chat-template", placeholder="FILE"),
    Setting.GENERIC_TOOLS_OFF: Words("--no-generic-tools"),
}


def _say(mention: Mention) -> str:
    words = WORDS[mention.setting]
    if mention.value is not None:
        return f"{words.said} {mention.value}"
    if not mention.every_way:
        return words.said
    said = f"{words.said} {words.placeholder}".rstrip()
    return f"{said} or the {words.key} key" if words.key else said


def worded(text: str) -> str:
    """`text` in the app's words: the settings an `EngineText` names said as flags or keys; other text as it is."""
    if not isinstance(text, EngineText):
        return text
    return "".join(part if isinstance(part, str) else _say(part) for part in text.parts)


def error_text(exc: BaseException) -> str:
    """What the app shows for an error: the engine's in the app's words, any other as `str()` gives it."""
    message = getattr(exc, "message", None)
    return worded(message) if isinstance(message, EngineText) else str(exc)


def _prefix_cache(event: PrefixCacheEvent | None) -> PrefixCacheEvent | None:
    if event is None or not isinstance(event.note, EngineText):
        return event
    return replace(event, note=worded(event.note))


def _result(result: RequestResult) -> RequestResult:
    prefix_cache = _prefix_cache(result.prefix_cache)
    if not isinstance(result.error, EngineText) and prefix_cache is result.prefix_cache:
        return result
    return replace(result, error=worded(result.error) if result.error is not None else None, prefix_cache=prefix_cache)


def with_engine_text() -> tuple[type, ...]:
    """The events that may carry engine text: `in_app_event` words these, and passes any other on as it is
    (a consumer tests `isinstance(event, with_engine_text())` so that a token never takes the detour)."""
    from minengine.engine.events import DoneEvent, PrefixCacheEvent  # here: error_text's users need no torch

    return (PrefixCacheEvent, DoneEvent)


def in_app_event(event: Event) -> Event:
    """`event` with the texts it carries in the app's words (itself when it carries none)."""
    from minengine.engine.events import DoneEvent, PrefixCacheEvent

    if isinstance(event, PrefixCacheEvent):
        return _prefix_cache(event)
    if isinstance(event, DoneEvent) and event.result is not None:
        result = _result(event.result)
        return event if result is event.result else DoneEvent(result)
    return event


def in_app_words(events: Iterable[Event]) -> Iterator[Event]:
    """The engine's events, with the texts they carry in the app's words (the rest passed on as they are)."""
    for event in events:
        yield in_app_event(event)
