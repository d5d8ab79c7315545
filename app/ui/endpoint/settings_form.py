"""The endpoint explorer's settings form: the sampling and logprobs of the next request.

Unlike the engine explorer's form, a field may be blank: a blank sampling field is left out of
the request, so the server's default applies, and a blank logprobs field asks for none. Only
the type and the plain bounds are checked here; the server judges the rest and says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from minengine.errors import RequestError
from reqscope.endpoint.settings import LOGPROBS_COST_NOTE, RequestSettings
from reqscope.ui.field_form import Field, FieldForm, field_reader


def _text(name: str, kind: type, settings: RequestSettings) -> str:
    value = getattr(settings, name)
    return "" if value is None else (f"{value:g}" if kind is float else str(value))


def _read(label: str, kind: type, text: str) -> float | int | None:
    text = text.strip()
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise RequestError(f"{label} must be {what} or blank; got {text!r}") from None


def _field(name: str, label: str, kind: type, hint: str) -> Field[RequestSettings]:
    """A field that reads as `kind`, or as None (left to the server) when blank."""
    return Field(name, label, hint, partial(_text, name, kind), partial(_read, label, kind))


FIELDS: tuple[Field[RequestSettings], ...] = (
    _field("temperature", "temperature", float, "blank = server default; 0 = greedy"),
    _field("top_k", "top-k", int, "blank = server default"),
    _field("top_p", "top-p", float, "blank = server default"),
    _field("min_p", "min-p", float, "blank = server default"),
    _field("seed", "seed", int, "blank = server default"),
    _field("max_tokens", "max tokens", int, "blank = server default"),
    _field("top_logprobs", "logprobs", int, "blank = off; N = top N per token"),
)


def settings_values(settings: RequestSettings) -> dict[str, str]:
    """The text each field starts with: blank for what is left to the server."""
    return {field.name: field.text(settings) for field in FIELDS}


def parse_settings(values: Mapping[str, str]) -> RequestSettings:
    """Read the fields; a blank one is None. RequestError names the first bad field."""
    read = field_reader(FIELDS, values)
    parsed = {field.name: read(field.name) for field in FIELDS}
    if parsed["max_tokens"] is not None and parsed["max_tokens"] < 1:
        raise RequestError(f"max tokens must be at least 1 or blank; got {parsed['max_tokens']}")
    if parsed["top_logprobs"] is not None and parsed["top_logprobs"] < 0:
        raise RequestError(f"logprobs must be 0 or more, or blank for none; got {parsed['top_logprobs']}")
    return RequestSettings(**parsed)


class EndpointSettingsForm(FieldForm[RequestSettings]):
    """Edit the next request's sampling and logprobs; Apply (or enter) keeps them for `r`."""

    BOX_TITLE = "Next request"
    NOTE = f"blank: left out, the server's default applies · {LOGPROBS_COST_NOTE}"
    FIELDS = FIELDS

    def parse(self, values: Mapping[str, str]) -> RequestSettings:
        return parse_settings(values)
