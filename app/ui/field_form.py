"""A modal form over a table of fields: a labelled input per field, an error line, Apply and Cancel.

Both explorers' settings forms are a `FieldForm`: the engine explorer's sampling
(`reqscope.ui.run.sampling_form`) and the endpoint explorer's next request
(`reqscope.ui.endpoint.settings_form`). A form names its fields and how their texts make its
record (`parse`); every edit is read at once, so a bad field is named while it is typed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from minengine.errors import RequestError
from reqscope.wording import error_text

R = TypeVar("R")  # the record a form edits


@dataclass(frozen=True)
class Field(Generic[R]):
    """One row of a form: its input, the text it starts with, and how that text is read."""

    name: str  # the input's id is "field-NAME"
    label: str
    hint: str  # shown while the input is blank
    text: Callable[[R], str]  # the field's text for the record being edited
    read: Callable[[str], Any]  # the value its text stands for; RequestError names the field


def field_reader(fields: tuple[Field[R], ...], values: Mapping[str, str]) -> Callable[[str], Any]:
    """`read(name)`: the value of field `name` in `values` (a field missing there reads as blank)."""
    by_name = {field.name: field for field in fields}
    return lambda name: by_name[name].read(values.get(name, ""))


class FieldForm(ModalScreen[R | None]):
    """Edit a record field by field; Apply (or enter) returns it when every field reads, escape returns None."""

    BOX_TITLE: ClassVar[str]
    NOTE: ClassVar[str] = ""  # a line above the fields, if any
    FIELDS: ClassVar[tuple[Field, ...]]
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: R, preview: Callable[[R], None] | None = None) -> None:
        super().__init__()
        self.current = current
        self.preview = preview  # called with every edit that reads, to show it before it applies

    def parse(self, values: Mapping[str, str]) -> R:
        """The record the fields' texts make; RequestError names the first bad field."""
        raise NotImplementedError

    def compose(self) -> ComposeResult:
        with Vertical(id="form-box") as box:
            box.border_title = self.BOX_TITLE
            if self.NOTE:
                yield Static(self.NOTE, id="form-note")
            for field in self.FIELDS:
                with Horizontal(classes="form-row"):
                    yield Label(field.label, classes="form-label")
                    yield Input(field.text(self.current), id=f"field-{field.name}", placeholder=field.hint,
                                classes="form-input")
            yield Static("", id="form-error")
            with Horizontal(id="form-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _read(self) -> R | None:
        error = self.query_one("#form-error", Static)
        values = {field.name: self.query_one(f"#field-{field.name}", Input).value for field in self.FIELDS}
        try:
            record = self.parse(values)
        except RequestError as exc:
            error.update(error_text(exc))
            return None
        error.update("")
        return record

    @on(Input.Changed)
    def _changed(self) -> None:
        record = self._read()
        if record is not None and self.preview is not None:
            self.preview(record)

    @on(Input.Submitted)
    @on(Button.Pressed, "#apply")
    def _apply(self) -> None:
        record = self._read()
        if record is not None:
            self.dismiss(record)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        """Close without changing anything."""
        self.dismiss(None)
