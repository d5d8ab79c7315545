"""One request run by the engine on the explorer's run thread, held and released by the UI.

The run thread (`RunThread`) runs the explorer's runs one after another, off the UI thread; the
engine's own loads and steps go to the process's model thread (`minengine.threads.model_thread`).
A run pulls events from the session and drops each into `inbox` (a deque: appends and
pops are atomic, so no lock). It calls `wake` only when the UI has taken everything it was
woken for, so a burst of tokens costs the UI thread one message, not one per token; a held
step and the end of the run always wake it (`urgent`). At every
`StepReady` it asks the gate whether to go on: running, it never waits; paused, it waits
there with the next token's logits computed, which is the only moment the session's step
controls are valid. A wait there is the person's time, not the engine's: the gate tells the
session it holds (`RequestSession.hold`), so the token after it carries that time as `held_ms`
and the engine's own ITL leaves it out.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from minengine.engine.engine import Engine
from minengine.engine.events import Event, StepReady
from minengine.engine.request import GenerationRequest
from minengine.engine.session import RequestSession
from minengine.inspect.ask import NOTHING, InspectAsk
from minengine.inspect.records import StepInspection
from minengine.sampling.grammar import needs_grammar
from minengine.sampling.params import SamplingParams
from minengine.sampling.step_trace import StepTrace
from minengine.threads import SerialThread
from reqscope.wording import in_app_event, with_engine_text

T = TypeVar("T")


class RunThread(SerialThread):
    """The explorer's run thread: loading, then each run's consumer (it pulls the session's events,
    samples a steered run's tokens, holds at a step for the person) and each weight comparison,
    one after another. It does no OpenMP work of its own: the engine hands its model work to the
    process's model thread."""

    def __init__(self) -> None:
        super().__init__("reqscope-runs")

    async def run(self, fn: Callable[..., T], /, *args: object) -> T:
        """Await `fn(*args)` run on the thread (from the UI's event loop)."""
        return await asyncio.wrap_future(self.submit(fn, *args))


class LiveRun:
    """A request on the engine, with run / pause / step / cancel and the paused-step controls."""

    def __init__(
        self,
        engine: Engine,
        request: GenerationRequest,
        *,
        paused: bool = False,
        grammar: bool = True,
        wake: Callable[[bool], object] = lambda urgent: None,
        observe: Callable[[Event], object] | None = None,
    ) -> None:
        self.engine = engine
        # observe(event), on the worker thread as each event leaves the engine (load that follows
        # the request's steps must not wait for the screen to take them); None: nothing follows
        self.observe = observe
        self.request = request
        self.grammar = grammar  # False: the request's grammar is turned off before it runs (the form's switch)
        self.wake = wake  # wake(urgent), called from the worker thread: must be thread-safe and quick
        self.inbox: deque[Event] = deque()
        self.recorded: list[Event] = []
        self.finished = threading.Event()
        self.failure: str | None = None  # an unexpected exception on the worker, as one line
        self.session: RequestSession | None = None
        self._cond = threading.Condition()
        self._budget: int | None = 0 if paused else None  # steps left before holding; None = run
        self._held_at: int | None = None
        self._cancelled = False
        self._woken = False
        self._ask = NOTHING  # what each step captures
        self._held_ask: InspectAsk | None = None  # what a held step's full view computes; None: nothing shown
        self._held_done: tuple[int, InspectAsk] | None = None  # the held step and ask last computed
        self.held_view: tuple[int, StepInspection | None] | None = None  # (held step, its full view)

    # -- the worker side -------------------------------------------------------------------------

    def drive(self, after: LiveRun | None = None) -> None:
        """Run the request to its end (call on a worker thread); waits for `after` to end first."""
        try:
            if after is not None:
                after.finished.wait()
            session = self.engine.start(self.request)
            with self._cond:
                self.session = session
                if self._ask.anything:  # a session starts asking nothing
                    session.inspect(self._ask)
                if not self.grammar and needs_grammar(self.request):
                    session.set_grammar(False)
                if self._cancelled:
                    session.cancel()
            worded = with_engine_text()
            for event in session:
                if isinstance(event, worded):  # a token never carries engine text: no detour for it
                    event = in_app_event(event)
                self.recorded.append(event)
                self.inbox.append(event)
                if self.observe is not None:
                    self.observe(event)
                self._signal()
                if isinstance(event, StepReady):
                    self._gate(event.index, session)
        except Exception as exc:  # a bug must reach the screen as a message, not kill the app
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.finished.set()
            self._signal(urgent=True)

    def _signal(self, urgent: bool = False) -> None:
        if urgent or not self._woken:
            self._woken = True
            self.wake(urgent)

    def _gate(self, index: int, session: RequestSession) -> None:
        with self._cond:
            while self._budget == 0 and not self._cancelled:
                if self._held_at != index:
                    self._held_at = index
                    session.hold()  # from here until the next pull is held time, not the engine's
                    self._signal(urgent=True)  # the UI must learn the step is now held
                ask = self._held_ask
                if ask is not None and self._held_done != (index, ask):
                    self._held_done = (index, ask)
                    self._cond.release()  # the UI may pause, step or cancel meanwhile
                    try:
                        view = session.inspect_step(ask)
                    finally:
                        self._cond.acquire()
                    self.held_view = (index, view)
                    self._signal(urgent=True)
                    continue
                self._cond.wait()
            self._held_at = None
            if self._budget:
                self._budget -= 1

    # -- the UI side -----------------------------------------------------------------------------

    def take(self) -> list[Event]:
        """Every event not taken yet; the next event after this wakes the UI again."""
        self._woken = False  # first: an event appended from here on signals anew
        events = []
        while self.inbox:
            events.append(self.inbox.popleft())
        return events

    @property
    def held_at(self) -> int | None:
        """Index of the step the worker is holding at, or None while it runs."""
        with self._cond:
            return self._held_at

    @property
    def pausing(self) -> bool:
        """True when the run will hold (or holds) at the next step."""
        with self._cond:
            return self._budget == 0

    def inspect(self, running: InspectAsk, held: InspectAsk | None) -> None:
        """Capture `running` in every step from the next on, and compute `held` for a held step (None: not)."""
        with self._cond:
            self._ask, self._held_ask = running, held
            if self.session is not None:
                self.session.inspect(running)
            self._cond.notify_all()  # a step held now computes its full view

    def pause(self) -> None:
        """Hold at the next step."""
        with self._cond:
            self._budget = 0

    def resume(self) -> None:
        """Run freely to the end."""
        with self._cond:
            self._budget = None
            self._cond.notify_all()

    def step(self) -> None:
        """Commit one token, then hold at the step after it."""
        with self._cond:
            self._budget = 1
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop the request before its next model step (also releases a held step)."""
        with self._cond:
            self._cancelled = True
            if self.session is not None:
                self.session.cancel()
            self._cond.notify_all()

    def _held_session(self) -> RequestSession:
        session = self.session
        if session is None or self.held_at is None:
            raise RuntimeError("the run is not held at a step")
        return session

    def preview(self, params: SamplingParams) -> StepTrace | None:
        """The held step re-filtered under `params` (no model run)."""
        return self._held_session().preview(params)

    def force_next(self, token_id: int) -> None:
        """Commit `token_id` at the held step."""
        self._held_session().force_next(token_id)

    def update_sampling(self, params: SamplingParams) -> None:
        """Use `params` from the held step on; raises RequestError when invalid."""
        self._held_session().update_sampling(params)

    def set_grammar(self, on: bool) -> None:
        """Turn the request's grammar off or on from the held step on; RequestError when the output
        so far does not fit it (it stays off)."""
        self._held_session().set_grammar(on)
