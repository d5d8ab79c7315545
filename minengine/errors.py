"""Errors the engine raises for bad input.

Every error carries a one-line message that names what is wrong and what to do about it, so
the CLI can print it as is (no traceback) and the UI can show it in place.
"""


class ReqscopeError(Exception):
    """Base class: a user-facing problem with a one-line, actionable message."""

    exit_code = 1  # what the command line exits with


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
