"""The sampling settings form: the chain's parameters, seed, max tokens and order, checked as typed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from minengine.errors import RequestError
from minengine.sampling.sampler import NAMED_ORDERS, SamplingParams
from reqscope.wording import error_text

# (field, label, hint)
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("temperature", "temperature", "0 = greedy"),
    ("top_k", "top-k", "0 = off"),
    ("top_p", "top-p", "1 = off"),
    ("min_p", "min-p", "0 = off"),
    ("seed", "seed", "blank = random"),
    ("max_tokens", "max tokens", "applies on restart (r)"),
    ("order", "sampler order", "hf, llama.cpp, vllm or a comma list"),
)


@dataclass(frozen=True)
class SamplingChoice:
    """What the form returns: parameters for the next steps and the token limit for the next run."""

    params: SamplingParams
    max_tokens: int


def order_text(order: tuple[str, ...]) -> str:
    """An order as its engine name when it has one, else as a comma list."""
    named = {v: k for k, v in NAMED_ORDERS.items()}
    return named.get(order, ",".join(order))


def form_values(choice: SamplingChoice) -> dict[str, str]:
    """The text each field starts with."""
    p = choice.params
    return {
        "temperature": f"{p.temperature:g}",
        "top_k": str(p.top_k),
        "top_p": f"{p.top_p:g}",
        "min_p": f"{p.min_p:g}",
        "seed": "" if p.seed is None else str(p.seed),
        "max_tokens": str(choice.max_tokens),
        "order": order_text(p.order),
    }


def parse_choice(values: dict[str, str], base: SamplingParams) -> SamplingChoice:
    """Read the fields into a validated choice; RequestError names the first bad field."""
    def number(name: str, kind: type):
        text = values[name].strip()
        try:
            return kind(text)
        except ValueError:
            raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}; got {text!r}") from None

    seed_text = values["seed"].strip()
    params = base.with_(
        temperature=number("temperature", float),
        top_k=number("top_k", int),
        top_p=number("top_p", float),
        min_p=number("min_p", float),
        seed=number("seed", int) if seed_text else None,
        order=SamplingParams.parse_order(values["order"]),
    )
    params.validate()
    max_tokens = number("max_tokens", int)
    if max_tokens < 1:
        raise RequestError(f"max tokens must be at least 1; got {max_tokens}")
    return SamplingChoice(params, max_tokens)


class SamplingForm(ModalScreen[SamplingChoice | None]):
    """Edit the sampling settings; every valid edit is previewed on the waiting step at once."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(
        self, current: SamplingChoice, preview: Callable[[SamplingParams], None], omit: frozenset[str] = frozenset()
    ) -> None:
        super().__init__()
        self.current = current
        self.preview = preview
        self.omit = omit  # fields that mean nothing here (the sampler order, on a server that picks its own)

    def compose(self) -> ComposeResult:
        values = form_values(self.current)
        with Vertical(id="form-box") as box:
            box.border_title = "Sampling"
            for name, label, hint in FIELDS:
                if name in self.omit:
                    continue
                with Horizontal(classes="form-row"):
                    yield Label(label, classes="form-label")
                    yield Input(values[name], id=f"field-{name}", placeholder=hint, classes="form-input")
            yield Static("", id="form-error")
            with Horizontal(id="form-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _values(self) -> dict[str, str]:
        values = form_values(self.current)  # omitted fields keep their current value
        for name, _, _ in FIELDS:
            if name not in self.omit:
                values[name] = self.query_one(f"#field-{name}", Input).value
        return values

    def _read(self) -> SamplingChoice | None:
        error = self.query_one("#form-error", Static)
        try:
            choice = parse_choice(self._values(), self.current.params)
        except RequestError as exc:
            error.update(error_text(exc))
            return None
        error.update("")
        return choice

    @on(Input.Changed)
    def _changed(self) -> None:
        choice = self._read()
        if choice is not None:
            self.preview(choice.params)

    @on(Input.Submitted)
    @on(Button.Pressed, "#apply")
    def _apply(self) -> None:
        choice = self._read()
        if choice is not None:
            self.dismiss(choice)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        """Close without changing anything (the preview goes back to the current settings)."""
        self.preview(self.current.params)
        self.dismiss(None)
