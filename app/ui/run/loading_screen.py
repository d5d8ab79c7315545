"""Startup: the engine loads, with its progress while the model is pulled and loaded, or why it could not.

The screen runs the loader it is given and is dismissed with the engine; on a failure it stays,
with the error, until the person quits. Each stage of a pull or a first load (download, verify,
convert, layout, cache) gets one row with its own progress bar, the amount done, the rate and
the ETA; plain messages ("loading ...") go to the log below the bars.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, Log, ProgressBar, Static

from minengine.engine.engine import Engine
from minengine.errors import ReqscopeError
from minengine.progress import PullProgress, StatusCallback
from reqscope.console.progress_line import eta_text, finished_line, progress_amount, rate_text
from reqscope.wording import error_text


class StageRow(Horizontal):
    """One stage: its name, a bar (indeterminate while the total is unknown) and what is done."""

    DEFAULT_CSS = """
    StageRow { height: 1; }
    StageRow > .stage-title { width: 20; }
    StageRow > ProgressBar { width: auto; margin-right: 2; }
    StageRow > .stage-detail { width: 1fr; }
    """

    def __init__(self, event: PullProgress) -> None:
        super().__init__(classes="stage-row")
        self.event = event

    def compose(self) -> ComposeResult:
        yield Static(Text(self.event.title), classes="stage-title")
        yield ProgressBar(total=self.event.total, show_eta=False)
        yield Static("", classes="stage-detail")

    def on_mount(self) -> None:
        self._draw()

    def show(self, event: PullProgress) -> None:
        """Move the row to `event` (drawn now, or once the row is mounted)."""
        self.event = event
        if self.is_mounted:
            self._draw()

    def _draw(self) -> None:
        event = self.event
        bar = self.query_one(ProgressBar)
        if event.finished:
            done = max(event.done, event.total or 0, 1)
            bar.update(total=done, progress=done)
            detail = finished_line(event).removeprefix(f"{event.title} done: ")
        else:
            bar.update(total=event.total, progress=event.done)
            parts = [progress_amount(event), rate_text(event), eta_text(event), event.message]
            detail = " · ".join(part for part in parts if part)
        self.query_one(".stage-detail", Static).update(Text(detail, no_wrap=True, overflow="ellipsis"))
        self.set_class(event.finished, "-finished")


EngineLoader = Callable[[StatusCallback], Awaitable[Engine]]


class LoadingScreen(Screen[Engine]):
    """A spinner, one progress bar per stage, and the loader's messages; on failure, the error."""

    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]
    DEFAULT_CSS = """
    #loading-stages { height: auto; margin-bottom: 1; }
    """

    def __init__(self, load: EngineLoader, failed: Callable[[str], object]) -> None:
        """`load(progress)` loads the engine off the UI thread; `failed(message)` hears why it could not."""
        super().__init__()
        self._load = load
        self._failed = failed
        self._rows: dict[tuple[str, float | None], StageRow] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static("reqscope: starting the engine", id="loading-title")
            yield LoadingIndicator(id="loading-spinner")
            yield Vertical(id="loading-stages")
            yield Log(id="loading-log", auto_scroll=True)
            yield Static("", id="loading-error")
        yield Footer()

    def on_mount(self) -> None:
        self._load_engine()

    @work(group="loader", exit_on_error=False)
    async def _load_engine(self) -> None:
        def progress(message: str | PullProgress) -> None:
            self.app.call_from_thread(self.add_message, message)

        try:
            engine = await self._load(progress)
        except ReqscopeError as exc:
            self._fail(error_text(exc))
            return
        except Exception as exc:  # a bug: on the loading screen, not a silent stall
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        self.dismiss(engine)

    def _fail(self, message: str) -> None:
        self.show_error(message)
        self._failed(message)

    def add_message(self, message: str | PullProgress) -> None:
        """A plain message goes to the log; a stage event moves that stage's bar."""
        if isinstance(message, PullProgress):
            self.show_progress(message)
        else:
            self.query_one(Log).write_line(message)

    def show_progress(self, event: PullProgress) -> None:
        """Draw `event` on its stage's row, adding the row when the stage is new."""
        key = (event.stage, event.started)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = StageRow(event)
            self.query_one("#loading-stages", Vertical).mount(row)
        else:
            row.show(event)

    def show_error(self, message: str) -> None:
        """Stop the spinner and show why the engine could not start."""
        self.query_one(LoadingIndicator).display = False
        error = self.query_one("#loading-error", Static)
        error.update(f"error: {message}\n\npress q to quit")
        error.add_class("-shown")
