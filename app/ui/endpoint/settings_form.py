"""The endpoint explorer's settings form: the sampling and logprobs of the next request.

Unlike the engine explorer's form, a field may be blank: a blank sampling field is left out of
the request, so the server's default applies, and a blank logprobs field asks for none. Only
the type and the plain bounds are checked here; the server judges the rest and says so.
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from minengine.errors import RequestError
from reqscope.endpoint.settings import LOGPROBS_COST_NOTE, RequestSettings
from reqscope.wording import error_text

# (field, label, kind, hint)
FIELDS: tuple[tuple[str, str, type, str], ...] = (
    ("temperature", "temperature", float, "blank = server default; 0 = greedy"),
    ("top_k", "top-k", int, "blank = server default"),
    ("top_p", "top-p", float, "blank = server default"),
    ("min_p", "min-p", float, "blank = server default"),
    ("seed", "seed", int, "blank = server default"),
    ("max_tokens", "max tokens", int, "blank = server default"),
    ("top_logprobs", "logprobs", int, "blank = off; N = top N per token"),
)


def settings_values(settings: RequestSettings) -> dict[str, str]:
    """The text each field starts with: blank for what is left to the server."""
    values = {}
    for name, _, kind, _ in FIELDS:
        value = getattr(settings, name)
        values[name] = "" if value is None else (f"{value:g}" if kind is float else str(value))
    return values


def parse_settings(values: dict[str, str]) -> RequestSettings:
    """Read the fields; a blank one is None. RequestError names the first bad field."""
    parsed: dict[str, float | int | None] = {}
    for name, label, kind, _ in FIELDS:
        text = values.get(name, "").strip()
        if not text:
            parsed[name] = None
            continue
        try:
            parsed[name] = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise RequestError(f"{label} must be {what} or blank; got {text!r}") from None
    if parsed["max_tokens"] is not None and parsed["max_tokens"] < 1:
        raise RequestError(f"max tokens must be at least 1 or blank; got {parsed['max_tokens']}")
    if parsed["top_logprobs"] is not None and parsed["top_logprobs"] < 0:
        raise RequestError(f"logprobs must be 0 or more, or blank for none; got {parsed['top_logprobs']}")
    return RequestSettings(**parsed)


class EndpointSettingsForm(ModalScreen[RequestSettings | None]):
    """Edit the next request's sampling and logprobs; Apply (or enter) keeps them for `r`."""

    DEFAULT_CSS = """
    EndpointSettingsForm { align: center middle; }
    #settings-note { color: $text-muted; height: auto; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: RequestSettings) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        values = settings_values(self.current)
        with Vertical(id="form-box") as box:
            box.border_title = "Next request"
            yield Static(f"blank: left out, the server's default applies · {LOGPROBS_COST_NOTE}", id="settings-note")
            for name, label, _, hint in FIELDS:
                with Horizontal(classes="form-row"):
                    yield Label(label, classes="form-label")
                    yield Input(values[name], id=f"field-{name}", placeholder=hint, classes="form-input")
            yield Static("", id="form-error")
            with Horizontal(id="form-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _read(self) -> RequestSettings | None:
        error = self.query_one("#form-error", Static)
        values = {name: self.query_one(f"#field-{name}", Input).value for name, _, _, _ in FIELDS}
        try:
            settings = parse_settings(values)
        except RequestError as exc:
            error.update(error_text(exc))
            return None
        error.update("")
        return settings

    @on(Input.Changed)
    def _changed(self) -> None:
        self._read()  # says at once which field is wrong

    @on(Input.Submitted)
    @on(Button.Pressed, "#apply")
    def _apply(self) -> None:
        settings = self._read()
        if settings is not None:
            self.dismiss(settings)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        """Close without changing anything."""
        self.dismiss(None)
