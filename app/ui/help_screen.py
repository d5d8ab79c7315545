"""The help screen: every key of the current mode, with what it does."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from reqscope.ui.keys import keys_for


class HelpScreen(ModalScreen[None]):
    """A scrollable table of keys; any of escape, q or ? closes it."""

    BINDINGS = [
        Binding("escape,q,question_mark,f1", "close", "Close"),
    ]

    def __init__(self, mode: str, panels: tuple[str, ...] = ()) -> None:
        """`panels`: the optional detail panels that apply (their keys are listed too)."""
        super().__init__()
        self.mode = mode
        self.panels = panels

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=True, header_style="bold", expand=True, pad_edge=False)
        table.add_column("key", no_wrap=True, style="bold")
        table.add_column("does")
        for key in keys_for(self.mode, self.panels):
            table.add_row(key.display, key.help)
        table.add_row("ctrl+p", "Command palette: every action by name")
        with VerticalScroll(id="help-box") as box:
            box.border_title = f"Keys ({self.mode})"
            box.border_subtitle = "escape closes"
            yield Static(table)

    def action_close(self) -> None:
        """Back to the explorer."""
        self.dismiss(None)
