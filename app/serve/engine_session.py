"""One HTTP request's engine session, run on a worker thread and read from the event loop.

The session blocks (in the scheduler's queue, in prefill, in every decode step), so it runs
on its own thread and hands the handler only what the response needs: admission, each token
(with its logprobs when asked for) and the end. The handler awaits these in order. When the
client goes away the handler calls `cancel()`, and the session stops before its next model
step. The telemetry record is written from the worker as the session ends, so it exists even
when the handler is long gone. A client that leaves while its request still waits in the
queue is told apart there (the engine reports it as an admission failure), so the record says
it was cancelled after its real wait, not that it failed.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from minengine.engine.batch_facts import PreemptEvent
from minengine.engine.engine import Engine
from minengine.engine.events import AdmitEvent, DoneEvent, RequestResult, StepReady, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.engine.timeline import Timeline
from minengine.errors import ReqscopeError
from reqscope.openai.logprobs import TokenLogprob
from reqscope.serve.logprobs import LogprobProbe
from reqscope.wording import in_app_event


@dataclass(frozen=True)
class Admitted:
    """The scheduler admitted the request (after any wait in the queue)."""

    event: AdmitEvent


@dataclass(frozen=True)
class Generated:
    """One token; `logprob` is set when the request asked for logprobs. The handler sets `written`
    once the token's chunk is written (or it made none)."""

    token: TokenEvent
    logprob: TokenLogprob | None
    written: threading.Event | None = None  # for the last token: set once its chunk is written


# How long a worker waits for its last token's chunk to be written before it lets the session end.
# Ending is Python on the worker's thread (the prefix cache's blocks, the result, the metrics):
# many workers ending in one step took the GIL from the event loop and delayed each last token
# (docs/serving.md, "The last token"). The bound keeps a client that reads slowly from holding it.
WRITTEN_WAIT_S = 0.05


@dataclass(frozen=True)
class Ended:
    """The session finished; `failure` says why when it failed."""

    result: RequestResult
    failure: ReqscopeError | None


@dataclass(frozen=True)
class SessionEnd:
    """How a session ended, for its telemetry record."""

    result: RequestResult
    disconnect_ms: float | None  # when the handler noticed the client was gone, on the timeline


@dataclass(frozen=True)
class Crashed:
    """The worker hit an unexpected exception (a bug): the response must still end."""

    message: str


RunItem = Admitted | Generated | Ended | Crashed


class LoopInbox:
    """Items the worker threads hand to one event loop, delivered together.

    `call_soon_threadsafe` writes to the loop's self-pipe each time: with 8 requests decoding,
    8 writes and up to 8 wake-ups of the loop a step, each taking CPU from the step's threads on
    a 2-core machine. Here only the item that finds the inbox empty schedules a delivery; the
    items that follow before it runs ride along. Each queue still gets its items in order.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # kept by `_inboxes` under the loop: no reference back to it
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue[RunItem], RunItem]] = deque()

    def put(self, queue: asyncio.Queue[RunItem], item: RunItem) -> None:
        """Hand `item` to `queue` on the loop; raises RuntimeError once the loop has closed."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a delivery is scheduled and has not run yet
                return
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._items.clear()
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
        for queue, item in items:
            queue.put_nowait(item)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox] = weakref.WeakKeyDictionary()


def inbox_of(loop: asyncio.AbstractEventLoop) -> LoopInbox:
    """The loop's one inbox (made on the loop's own thread, the first time a run starts there)."""
    inbox = _inboxes.get(loop)
    if inbox is None:
        inbox = _inboxes[loop] = LoopInbox(loop)
    return inbox


class EngineRun:
    """A request's session on a worker thread; `next()` yields its items on the event loop."""

    def __init__(
        self,
        engine: Engine,
        request: GenerationRequest,
        timeline: Timeline,
        *,
        top_logprobs: int | None,
        on_end: Callable[[SessionEnd], None],
        on_exit: Callable[[], None] | None = None,
        on_preempt: Callable[[PreemptEvent], None] | None = None,
    ) -> None:
        # A server never holds or steers a step: the engine samples each token in the step itself.
        self.session = engine.start(request, timeline, steered=False)
        self.timeline = timeline
        self._probe = None if top_logprobs is None else LogprobProbe(top_logprobs, engine.tokenizer.piece)
        self._on_end = on_end
        self._on_exit = on_exit  # the worker is done, however it ended
        self._on_preempt = on_preempt  # the engine took the request's KV back (it runs again later)
        self._queue: asyncio.Queue[RunItem] = asyncio.Queue()
        self._inbox: LoopInbox | None = None
        self.finished = threading.Event()
        self._over = False  # the handler has read the end
        self.disconnect_ms: float | None = None

    def start(self) -> None:
        """Start the worker thread; call from the event loop that will read the items."""
        self._inbox = inbox_of(asyncio.get_running_loop())
        name = f"reqscope-{self.session.request.request_id}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    async def next(self) -> RunItem:
        """The next item, in the order the session produced them."""
        item = await self._queue.get()
        if isinstance(item, Ended | Crashed):
            self._over = True
        return item

    def cancel(self) -> None:
        """The client is gone: stop the session before its next step and note when.

        Does nothing once the end has been read or the worker has finished.
        """
        if not (self._over or self.finished.is_set()) and self.disconnect_ms is None:
            self.disconnect_ms = self.timeline.now_ms()
            self.session.cancel()

    def _post(self, item: RunItem) -> None:
        try:
            self._inbox.put(self._queue, item)
        except RuntimeError:  # the event loop has closed (server shutting down): nobody listens
            self.session.cancel()

    def _work(self) -> None:
        try:
            for event in self.session:
                if isinstance(event, StepReady) and self._probe is not None:
                    self._probe.capture(self.session.pending_logits)
                elif isinstance(event, AdmitEvent):
                    self._post(Admitted(event))
                elif isinstance(event, TokenEvent):
                    logprob = None if self._probe is None else self._probe.entry(event.token_id)
                    generated = Generated(event, logprob, threading.Event() if event.last else None)
                    self._post(generated)
                    if generated.written is not None:
                        generated.written.wait(WRITTEN_WAIT_S)
                elif isinstance(event, PreemptEvent) and self._on_preempt is not None:
                    self._on_preempt(event)
                elif isinstance(event, DoneEvent):
                    event = in_app_event(event)  # the result's error in the app's words (no token's detour)
                    self._on_end(SessionEnd(event.result, self.disconnect_ms))
                    self._post(Ended(event.result, self.session.failure))
        except Exception as exc:  # a bug must end the response with a 500, not hang it
            self._post(Crashed(f"{type(exc).__name__}: {exc}"))
        finally:
            self.finished.set()
            if self._on_exit is not None:
                self._on_exit()
