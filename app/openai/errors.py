"""OpenAI's error object, and the helpers every request reader builds its errors with."""

from __future__ import annotations

SHOWN_CHARS = 64  # the most of a client's value an error message echoes


class ApiError(Exception):
    """A request the API answers with an error status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.retry_after_s = retry_after_s
        # Answer, then close the connection without waiting for the rest of the body (a stall).
        self.close_connection = close_connection

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`, as OpenAI answers errors."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`value`'s repr for an error message, cut to `limit` characters.

    Errors echo what the client sent so the mistake is visible, but a 100,000-character model
    name must not come back in full: the echo is for reading, not a copy of the request.
    """
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text)} characters)"


def invalid(param: str, message: str) -> ApiError:
    """A 400 naming `param`."""
    return ApiError(400, message, param=param)


def one_line(text: str, limit: int = 200) -> str:
    """A library's (often multi-line) error message as one line for an error object."""
    joined = " ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return joined if len(joined) <= limit else joined[: limit - 1] + "…"
