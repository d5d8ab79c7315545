"""Edit the request's messages: the system prompt and the user prompt, then run again."""

from __future__ import annotations

from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea


@dataclass(frozen=True)
class PromptChoice:
    """The messages to run next (an empty system prompt means none)."""

    system: str
    prompt: str


class PromptForm(ModalScreen[PromptChoice | None]):
    """A system prompt line and a multi-line user prompt."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "run", "Run")]

    def __init__(self, current: PromptChoice, focus: str = "prompt") -> None:
        super().__init__()
        self.current = current
        self.focus_field = focus

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box") as box:
            box.border_title = "Prompt"
            box.border_subtitle = "ctrl+s runs · escape cancels"
            yield Label("system prompt (empty = none)")
            yield Input(self.current.system, id="system-input")
            yield Label("prompt")
            yield TextArea(self.current.prompt, id="prompt-input", soft_wrap=True)
            yield Static("", id="prompt-error")
            with Horizontal(id="prompt-buttons"):
                yield Button("Run", variant="primary", id="run")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(f"#{self.focus_field}-input").focus()

    @on(Button.Pressed, "#run")
    def action_run(self) -> None:
        """Close and run the edited messages."""
        prompt = self.query_one("#prompt-input", TextArea).text
        if not prompt.strip():
            self.query_one("#prompt-error", Static).update("the prompt is empty; type something to send")
            return
        self.dismiss(PromptChoice(self.query_one("#system-input", Input).value, prompt))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        """Close without running."""
        self.dismiss(None)
