"""The `w` key's work: load another format's engine on the model thread, run the comparison, publish it.

Each press takes the next format this machine runs (in `WEIGHT_FORMATS` order, then the reference
kernels, which show what the fast paths' speed costs in arithmetic; wrapping), loads
its engine unless it is the one kept (`other_engine`), and runs the finished request on screen
through both engines on its tokens (`lockstep`). Everything runs on the model thread, where the
explorer's runs go, so it queues behind them and they behind it. The screen reads `shown()`:
the newest comparison per format, the formats that cannot run and why, and what is loading.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from minengine.engine.engine import Engine
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.progress import PullProgress
from reqscope.other_formats import FormatOption, other_formats, run_label
from reqscope.ui.run.formats.agreement import FormatComparison
from reqscope.ui.run.formats.lockstep import compare_on_tokens
from reqscope.ui.run.formats.other_engine import OtherEngine
from reqscope.wording import error_text

Submit = Callable[..., Future]


@dataclass(frozen=True)
class FormatsShown:
    """What the formats panel draws: one repaint's copy."""

    baseline: str  # the explorer's own format
    options: tuple[FormatOption, ...]
    comparisons: tuple[FormatComparison, ...]  # the newest per format, in the options' order
    loading: str | None = None  # e.g. "loading int8 weights: lay out weights 120/210", while it loads
    running: str | None = None  # the format being compared now
    error: str | None = None  # why the last comparison failed
    kept: str | None = None  # the format whose engine stays loaded


class WeightComparer:
    """The explorer's weight-format comparisons: at most one at a time, one other engine kept."""

    def __init__(self, submit: Submit, wake: Callable[[], object]) -> None:
        """`submit(fn, *args)` queues on the model thread; `wake()` (thread-safe) asks for a repaint."""
        self._submit = submit
        self._wake = wake
        self._other = OtherEngine()
        self._lock = threading.RLock()  # _compared holds it around _update
        self._cancelled = threading.Event()
        self._busy = False
        self._news = False
        self._shown: FormatsShown | None = None
        self._by_format: dict[str, FormatComparison] = {}
        self._last: str | None = None

    @property
    def asked(self) -> bool:
        """True once a comparison was asked for (the panel applies from then on)."""
        return self._shown is not None

    @property
    def busy(self) -> bool:
        """True while a comparison loads or runs."""
        return self._busy

    def shown(self) -> FormatsShown | None:
        """The latest state, for the panel."""
        return self._shown

    def take_news(self) -> bool:
        """True when the state changed since the last call."""
        news, self._news = self._news, False
        return news

    def next_format(self, engine: Engine) -> FormatOption | None:
        """The format the next press compares: after the last one compared, among those that run here."""
        options = other_formats(engine, reference=True)
        if self._shown is None:
            self._publish(FormatsShown(run_label(engine), options, ()))
        runnable = [o for o in options if o.runs]
        if not runnable:
            return None
        names = [o.format for o in runnable]
        after = names.index(self._last) + 1 if self._last in names else 0
        return runnable[after % len(runnable)]

    def start(self, option: FormatOption, engine: Engine, request: GenerationRequest, tokens: tuple[int, ...]) -> None:
        """Compare `option` against `engine` on `tokens` (the finished run on screen), on the model thread."""
        self._busy, self._last = True, option.format
        self._cancelled.clear()
        self._update(loading=f"loading {option.format} weights", running=option.format, error=None)
        self._submit(self._run, option.format, engine, request, tokens)

    def cancel(self) -> None:
        """Stop the comparison in progress before its next step."""
        self._cancelled.set()

    # -- on the model thread ---------------------------------------------------------------

    def _run(self, fmt: str, engine: Engine, request: GenerationRequest, tokens: tuple[int, ...]) -> None:
        try:
            other, cost = self._other.load(engine, fmt, self._loading(fmt))
            self._update(loading=None, kept=fmt)
            compare_on_tokens(engine, other, request, tokens, cost=cost, publish=self._compared,
                              cancelled=self._cancelled)  # fmt: skip
        except ReqscopeError as exc:
            self._update(loading=None, error=f"{fmt}: {error_text(exc)}")
        except Exception as exc:  # a bug must reach the screen as a message, not kill the model thread
            self._update(loading=None, error=f"{fmt}: {type(exc).__name__}: {exc}")
        finally:
            self._busy = False
            self._update(running=None)

    def _loading(self, fmt: str) -> Callable[[PullProgress | str], None]:
        last = [0.0]

        def report(event: PullProgress | str) -> None:
            now = time.monotonic()
            if now - last[0] < 0.1 and not (isinstance(event, PullProgress) and event.finished):
                return  # the layout reports every tensor; the screen needs a few lines a second
            last[0] = now
            if isinstance(event, PullProgress):
                total = f"/{event.total}" if event.total else ""
                text = f"{event.title} {event.done}{total}"
            else:
                text = event
            self._update(loading=f"loading {fmt} weights: {text}")

        return report

    def _compared(self, comparison: FormatComparison) -> None:
        with self._lock:
            self._by_format[comparison.other.format] = comparison
            self._update()

    def _update(self, **changes: object) -> None:
        with self._lock:
            shown = self._shown
            assert shown is not None  # made by next_format before anything starts
            order = [o.format for o in shown.options]
            comparisons = tuple(self._by_format[f] for f in order if f in self._by_format)
            fields = {"loading": shown.loading, "running": shown.running, "error": shown.error, "kept": shown.kept}
            fields.update(changes)
            self._publish(FormatsShown(shown.baseline, shown.options, comparisons, **fields))  # type: ignore[arg-type]

    def _publish(self, shown: FormatsShown) -> None:
        self._shown = shown
        self._news = True
        self._wake()
