"""Reading a request body as JSON without letting a hostile body reach past the parser.

`json.loads` accepts more than the API can use, and some of it fails later in places that
answer with a bare 500: a lone UTF-16 surrogate (`"\\ud800"`) decodes to a Python string that
cannot be encoded back to UTF-8, an integer of thousands of digits trips Python's int-string
conversion limit, and arrays nested 100,000 deep exhaust the recursion limit. So the body is
decoded here, strictly, and every such problem becomes a 400 that names where it is (`param`),
before any field is validated. The read itself is bounded in time, so a client that sends
half a body and stalls is answered 408 and disconnected instead of holding the handler.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

from reqscope.openai.errors import ApiError

MAX_DEPTH = 32  # the API's deepest legitimate value is messages[i].content[j].text: depth 4
MAX_INT_DIGITS = 32  # seed, the largest integer field, fits in 20 digits
MAX_KEY_CHARS = 64  # a key named in `param` is cut to this, as echoed values are


@dataclass(frozen=True)
class _LongInteger:
    """An integer literal too long to convert; reported with its place once the body is parsed."""

    digits: int


async def read_json(request: web.Request, timeout_s: float) -> object:
    """The body parsed as JSON; raises ApiError (400 malformed, 408 too slow).

    A body over the app's `client_max_size` raises aiohttp's HTTPRequestEntityTooLarge, which
    the gateway answers with 413.
    """
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
            close_connection=True,
        ) from None
    return decode_json(raw)


def decode_json(raw: bytes) -> object:
    """Strict JSON (UTF-8, no NaN or Infinity, bounded depth and integer length, no lone surrogates)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 (at byte {exc.start})", param="body") from None
    try:
        value = json.loads(text, parse_int=_integer, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep("body") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", param="body") from None
    except ValueError as exc:  # from _no_constant
        raise ApiError(400, f"the body is not valid JSON: {exc}", param="body") from None
    _check_values(value)
    return value


def _integer(literal: str) -> int | _LongInteger:
    digits = len(literal.lstrip("-"))
    return int(literal) if digits <= MAX_INT_DIGITS else _LongInteger(digits)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(param: str) -> ApiError:
    return ApiError(400, f"the body nests values more than {MAX_DEPTH} levels deep", param=param)


def _check_values(value: object) -> None:
    """Raise a 400 naming the first over-deep value, over-long integer or lone surrogate.

    Walks with its own stack: the body's depth is what is being checked, so it must not also
    be the depth of this function's recursion.
    """
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        param = path or "body"
        if depth > MAX_DEPTH:
            raise _too_deep(param)
        if isinstance(item, _LongInteger):
            raise ApiError(
                400, f"{param} is an integer of {item.digits} digits (at most {MAX_INT_DIGITS})", param=param
            )
        if isinstance(item, str):
            _check_text(item, param)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_text(key, param)
                name = key if len(key) <= MAX_KEY_CHARS else key[: MAX_KEY_CHARS - 1] + "…"
                stack.append((inner, f"{path}.{name}" if path else name, depth + 1))
        elif isinstance(item, list):
            stack.extend((inner, f"{path}[{i}]", depth + 1) for i, inner in enumerate(item))


def _check_text(text: str, param: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"{param} holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}); "
            "send valid Unicode",
            param=param,
        ) from None
