"""The endpoint client on its own thread and event loop, so drawing never delays reading the stream.

The client stamps each chunk when it reads it. On the UI's event loop, a repaint in progress
would hold a chunk back and inflate the ITL it measures; on a thread of its own, the client
reads as the bytes arrive (waiting on the socket releases the GIL). One `EndpointClient` lives
as long as the explorer, so a second request reuses the first one's connection unless
`--new-connection` says otherwise, exactly as in the plain mode.

Each request is an `EndpointRequest`: its events land in `inbox` (a deque: atomic appends and
pops, no lock) and `wake(urgent)` is called when the UI has taken everything it was woken for,
so a burst of chunks costs the UI one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from reqscope.endpoint.client import EndpointClient
from reqscope.endpoint.controls import OutputControls
from reqscope.endpoint.events import ClientEvent, StreamEnded
from reqscope.endpoint.server.records import ServerKind
from reqscope.endpoint.settings import RequestSettings
from reqscope.endpoint.target import EndpointTarget, model_name
from reqscope.wording import error_text


class EndpointRequest:
    """One request in flight: its events so far, and a way to stop it."""

    def __init__(
        self,
        request: GenerationRequest,
        wake: Callable[[bool], object],
        settings: RequestSettings | None = None,
        controls: OutputControls | None = None,
    ) -> None:
        self.request = request
        self.settings = settings or RequestSettings()  # the sampling and logprobs the body carries
        self.controls = controls  # tools, output shape, penalties, bias; None: those the request carries
        self.wake = wake  # called from the client's thread: must be thread-safe and quick
        self.inbox: deque[ClientEvent] = deque()
        self.cancelled = False
        self.failure: str | None = None  # an unexpected exception in the client, as one line
        self.finished = threading.Event()
        self.future: Future | None = None
        self._woken = False

    def push(self, event: ClientEvent) -> None:
        """Hand one event to the UI (client thread)."""
        self.inbox.append(event)
        if not self._woken or isinstance(event, StreamEnded):
            self._woken = True
            self.wake(isinstance(event, StreamEnded))

    def end(self) -> None:
        """Mark the request over, however it ended, and wake the UI for it (client thread)."""
        self.finished.set()
        self.wake(True)

    def take(self) -> list[ClientEvent]:
        """Every event not taken yet; the next event after this wakes the UI again (UI thread)."""
        self._woken = False
        events = []
        while self.inbox:
            events.append(self.inbox.popleft())
        return events

    def cancel(self) -> None:
        """Close the stream now: the client drops the connection, which tells the server."""
        self.cancelled = True
        if self.future is not None:
            self.future.cancel()  # thread-safe: cancels the task on the client's loop


class EndpointWorker:
    """A thread running one event loop and one EndpointClient; requests are scheduled onto it."""

    def __init__(self, target: EndpointTarget) -> None:
        self.target = target
        self.model: str | None = None
        self.kind: ServerKind | None = None  # which server answers, once connected
        self._loop = asyncio.new_event_loop()
        self._client: EndpointClient | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="reqscope-endpoint", daemon=True)
        self._thread.start()

    def connect(self) -> str:
        """Open the client and settle the model name (blocks; call off the UI thread).

        Raises ReqscopeError with a one-line reason when the server cannot be reached, refuses
        the key, or lists no model and none was named.
        """
        return asyncio.run_coroutine_threadsafe(self._connect(), self._loop).result()

    async def _connect(self) -> str:
        if self._client is None:
            self._client = self.target.client()
            await self._client.__aenter__()
        self.model = await model_name(self._client, self.target)
        self.kind = await self._client.identify()
        return self.model

    def start(self, run: EndpointRequest) -> None:
        """Stream `run.request` on the client's loop; events go to `run`."""
        run.future = asyncio.run_coroutine_threadsafe(self._stream(run), self._loop)
        # A task cancelled before its first step never runs its `finally`: end the run here then.
        run.future.add_done_callback(lambda _f: None if run.finished.is_set() else run.end())
        if run.cancelled:  # cancelled before it was scheduled
            run.future.cancel()

    async def _stream(self, run: EndpointRequest) -> None:
        assert self._client is not None and self.model is not None, "connect() first"
        try:
            async for event in self._client.stream_chat(run.request, self.model, run.settings, run.controls):
                run.push(event)
        except asyncio.CancelledError:
            run.cancelled = True
            raise
        except ReqscopeError as exc:
            run.failure = error_text(exc)
        except Exception as exc:  # a bug must reach the screen as a message, not vanish with the thread
            run.failure = f"{type(exc).__name__}: {exc}"
        finally:
            run.end()

    def close(self) -> None:
        """Close the client and stop the thread (waits a moment for both)."""
        if self._client is not None:
            # Leaving anyway: a connection that will not close is the OS's to reap.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
