"""Startup: progress while the model is pulled and loaded, or the reason it could not be."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, Log, Static


class LoadingScreen(Screen[None]):
    """A spinner and the loader's messages; on failure, the error and a way out."""

    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static("reqscope: starting the engine", id="loading-title")
            yield LoadingIndicator(id="loading-spinner")
            yield Log(id="loading-log", auto_scroll=True)
            yield Static("", id="loading-error")
        yield Footer()

    def add_message(self, message: str) -> None:
        """Append one progress line."""
        self.query_one(Log).write_line(message)

    def show_error(self, message: str) -> None:
        """Stop the spinner and show why the engine could not start."""
        self.query_one(LoadingIndicator).display = False
        error = self.query_one("#loading-error", Static)
        error.update(f"error: {message}\n\npress q to quit")
        error.add_class("-shown")
