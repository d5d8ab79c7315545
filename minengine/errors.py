"""Errors the engine raises for bad input, and the words they name the engine's settings with.

Every error carries a one-line message that names what is wrong and what to do about it, so
the CLI can print it as is (no traceback) and the UI can show it in place. Where the way out is
a setting ("lower max_tokens"), the message names the engine's `Setting`, not a flag or a key:
the app says how its user changes that setting on each surface (`reqscope.wording`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Setting(Enum):
    """A choice the engine's user makes, by the engine's own name for it (the value)."""

    MODEL_DIR = "model_dir"
    DEVICE = "device"
    DTYPE = "dtype"
    WEIGHTS = "weights"
    MAX_TOKENS = "max_tokens"
    KV_BUDGET = "kv_budget_bytes"
    PREFIX_CACHE_OFF = "prefix_cache=False"
    BLOCK_SIZE = "block_size"
    MODEL_SAMPLING_DEFAULTS_OFF = "ModelSamplingDefaults()"  # generation_config.json left unread
    EXPORT_DIR = "export_dir"
    EXPORT_REPLACES = "force=True"  # prepare_export_folder's: replace the export files of the run before
    CALIBRATION_REPEATS = "repeats"
    CALIBRATION_DECODE_STEPS = "decode_steps"
    CALIBRATION_PROMPT_LENGTHS = "prompt_lengths"
    CALIBRATION_CONTEXT_LENGTHS = "context_lengths"
    CALIBRATION_SAVED = "calibrate()'s ServiceModel.as_json(), saved to"
    GGUF_IMPORT = "convert_gguf"
    PLANNER = "the planner"
    MAX_NUM_SEQS = "max_num_seqs"
    MAX_NUM_BATCHED_TOKENS = "max_num_batched_tokens"
    KERNELS = "kernels"
    CHAT_TEMPLATE_FILE = "chat_template_file"
    GENERIC_TOOLS_OFF = "generic_tools=False"


@dataclass(frozen=True)
class Mention:
    """A setting named in a message: by the engine as `name` or `name value`, by the app as a flag or a key."""

    setting: Setting
    value: str | None = None  # the value the message gives it ("cpu"), if any
    every_way: bool = False  # name each way to give it, with a placeholder for the value ("--model PATH")

    def __str__(self) -> str:
        return self.setting.value if self.value is None else f"{self.setting.value} {self.value}"


class EngineText(str):
    """Text in the engine's words that keeps the settings it names, so the app can word them its way.

    A str (its text in the engine's words), so the records that carry one (a result's `error`,
    an event's `note`) keep their type and their JSON form; `parts` are its text and `Mention`s.
    """

    parts: tuple[str | Mention, ...]

    def __new__(cls, *parts: str | Setting | Mention) -> EngineText:
        flat: list[str | Mention] = []
        for part in parts:
            if isinstance(part, EngineText):
                flat.extend(part.parts)
            elif isinstance(part, Setting):
                flat.append(Mention(part))
            else:
                flat.append(part)
        text = super().__new__(cls, "".join(map(str, flat)))
        text.parts = tuple(flat)
        return text


class ReqscopeError(Exception):
    """Base class: a user-facing problem with a one-line, actionable message.

    Made from text and settings: `ReqscopeError("...; lower ", Setting.MAX_TOKENS)`; `message`
    keeps them apart for the app, `str()` gives the engine's words.
    """

    exit_code = 1  # what the command line exits with

    def __init__(self, *parts: str | Setting | Mention) -> None:
        self.message = EngineText(*parts)
        super().__init__(self.message)


class NotATraceError(ReqscopeError):
    """A file given as a recorded trace is not one (wrong bytes, wrong JSON, no header)."""

    exit_code = 2  # the argument itself is wrong, as for a usage error


class ConfigError(ReqscopeError):
    """config.json describes a model this engine cannot run exactly."""


class WeightsError(ReqscopeError):
    """Checkpoint files are missing, malformed or do not match the config."""


class TokenizerError(ReqscopeError):
    """tokenizer.json or the chat template cannot be used."""


class ModelNotFoundError(ReqscopeError):
    """No model folder where one was expected."""


class PullError(ReqscopeError):
    """Fetching or converting the default model failed."""


class RequestError(ReqscopeError):
    """A request failed validation at the gateway (bad prompt or sampling parameters)."""


class AdmissionError(ReqscopeError):
    """A request cannot be admitted: token or KV-memory budget exceeded."""


class QueueCancelledError(AdmissionError):
    """The request was cancelled while it waited in the queue (its client left, say)."""

    def __init__(self, message: str, waited_ms: float) -> None:
        super().__init__(message)
        self.waited_ms = waited_ms  # how long it waited before it was let go


class QueueFullError(AdmissionError):
    """The admission queue is full; the request may succeed if sent again later."""
