"""Load beside the request on screen, in the same engine: background requests, and the OpenAI API.

`reqscope "PROMPT" --background N` keeps N other requests running while the user's own runs (the
explorer, `--plain`, `--json`): each background slot sends a request, and a new one when it
finishes, with prompts and output lengths of a few sizes, until the user's request ends. They
join once the user's request has decoded SOLO_STEPS steps alone, so the engine has timed its
step alone (`BatchStep.solo_step_ms`) and the user sees the steps slow down as the others come. With
`--serve-port PORT` the explorer's engine also answers the OpenAI API on loopback
(`reqscope.serve.app`), so `reqscope bench serve` or any client can join the batch. The user
sees their request slow down as others share its steps (the explorer's batch panel).

Background requests run on threads of their own; each iterates its session and keeps nothing
but a count. A held (paused, stepped) foreground request does not hold them: each session
goes on by itself.
"""

from __future__ import annotations

import argparse
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minengine.engine.events import DoneEvent, Event, TokenEvent
from minengine.engine.request import GenerationRequest
from minengine.errors import ReqscopeError
from minengine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from minengine.engine.engine import Engine
    from minengine.engine.session import RequestSession
    from reqscope.serve.runner import BackgroundServer

SERVE_HOST = "127.0.0.1"  # the explorer's API answers this machine only (it has no key)
# The engine admits by KV capacity now (its queue is bounded by memory); past the most sequences a
# step runs by default (vLLM's 256, `step_loop.DEFAULT_MAX_NUM_SEQS`: not imported, it loads torch)
# more background requests would only wait, so that, less the user's own request, is the cap.
MAX_BACKGROUND = 255
SOLO_STEPS = 2  # decode steps the user's request runs alone before the background requests join
_RETRY_S = 0.5  # a background request that failed is sent again after this (never a busy loop)
_PARAGRAPH = (
    "A request to a language model server passes a gateway, a chat template and a tokenizer, waits "
    "for admission, prefills its prompt into the KV cache and then decodes one token per step. "
)
# (prompt, output tokens): short, medium and long prompts, with outputs of a few lengths.
BACKGROUND_WORK: tuple[tuple[str, int], ...] = (
    ("Name three colours.", 48),
    ("Explain in a few sentences what a KV cache is and why it grows with every token.", 96),
    ("Summarise this text in two sentences:\n" + _PARAGRAPH * 8, 160),
    ("Write a short poem about trains.", 128),
)


class LoadError(ReqscopeError):
    """A load flag that cannot be used (too many background requests, a port taken)."""

    exit_code = 2  # the flag itself is wrong, as for a usage error


@dataclass(frozen=True)
class LoadNote:
    """What the explorer says on screen about the load it puts on its engine."""

    background: int  # background requests kept running beside the user's
    serve_url: str | None  # the OpenAI API's base URL (without /v1), None when not served


@dataclass(frozen=True)
class LoadOptions:
    """The load flags: background requests, and the port the engine's API listens on."""

    background: int = 0
    serve_port: int | None = None

    @property
    def any(self) -> bool:
        """True when the engine gets any load beside the user's request."""
        return self.background > 0 or self.serve_port is not None

    @classmethod
    def of(cls, args: argparse.Namespace) -> LoadOptions:
        """The options from `--background` and `--serve-port`; LoadError (one line) when they cannot be used."""
        background = getattr(args, "background", 0) or 0
        port = getattr(args, "serve_port", None)
        if background > MAX_BACKGROUND:
            raise LoadError(f"--background {background} is more than the engine's steps run at once with yours; "
                                f"give at most {MAX_BACKGROUND}")  # fmt: skip
        if port is not None:
            if port > 65535:
                raise LoadError(f"--serve-port {port} is not a TCP port (0-65535, 0 picks a free one)")
            check_port_free(port)
        return cls(background, port)


NO_LOAD = LoadOptions()


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """`--background N` and `--serve-port PORT` (the run verb: the explorer, --plain and --json)."""
    from reqscope.argtypes import whole_number

    g = parser.add_argument_group("load on the engine")
    g.add_argument("--background", type=whole_number, default=0, metavar="N",
                   help="keep N other requests running in the same engine while yours runs (prompts of a few "
                   f"lengths, a new one as each ends; at most {MAX_BACKGROUND})")  # fmt: skip
    g.add_argument("--serve-port", type=whole_number, metavar="PORT",
                   help=f"also serve the OpenAI API from this engine on {SERVE_HOST}:PORT while the request runs "
                   "(0 picks a free port), so `reqscope bench serve --base-url` or any client can join its batch")


def check_port_free(port: int, host: str = SERVE_HOST) -> None:
    """Raise a one-line LoadError when `port` cannot be listened on (checked before the model loads)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise LoadError(port_error(host, port, exc)) from None


def port_error(host: str, port: int, exc: OSError) -> str:
    """Why the API cannot listen, and what to do."""
    return f"cannot serve on {host}:{port}: {exc.strerror or exc}; pick another --serve-port (0 picks a free one)"


class BackgroundLoad:
    """`count` background requests, each followed by a new one, while started (`start` / `stop`)."""

    def __init__(self, engine: Engine, count: int, like: GenerationRequest) -> None:
        """`like` gives the background requests their cache layout, dtype and block size (the user's)."""
        self.engine = engine
        self.count = count
        self.like = like
        self.sent = 0  # background requests started
        self.finished = 0  # of them, run to their end (not cancelled, not failed)
        self.failed = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sessions: dict[int, RequestSession] = {}
        self._threads: list[threading.Thread] = []

    @property
    def running(self) -> bool:
        """True while the background slots are sending requests."""
        return any(t.is_alive() for t in self._threads) and not self._stop.is_set()

    def start(self) -> None:
        """Start every slot (again, after `stop`); does nothing while they run."""
        if self.count == 0 or self.running:
            return
        self.stop()  # the slots of a previous start must be gone before new ones begin
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._slot, args=(slot, self._stop), daemon=True, name=f"reqscope-bg-{slot}")
            for slot in range(self.count)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop every slot: each request is cancelled before its next model step; `wait` joins them."""
        self._stop.set()
        with self._lock:
            for session in self._sessions.values():
                session.cancel()
        if wait:
            for thread in self._threads:
                thread.join(timeout=30)

    def request(self, slot: int, n: int) -> GenerationRequest:
        """The `n`-th request of background slot `slot`."""
        prompt, max_tokens = BACKGROUND_WORK[(slot + n) % len(BACKGROUND_WORK)]
        like = self.like
        return GenerationRequest.from_prompt(
            prompt, sampling=SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=slot * 1000 + n),
            max_tokens=max_tokens, kv_layout=like.kv_layout, kv_dtype=like.kv_dtype, block_size=like.block_size,
            trace=False, request_id=f"bg{slot}-{n}-{like.request_id.removeprefix('req-')[:6]}",
        )  # fmt: skip

    def _slot(self, slot: int, stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            session = self.engine.start(self.request(slot, n), steered=False)  # no one steers background load
            with self._lock:
                self.sent += 1
                self._sessions[slot] = session
                if stop.is_set():
                    session.cancel()
            result = None
            try:
                for event in session:
                    if isinstance(event, DoneEvent):
                        result = event.result
            except Exception as exc:  # a bug in one background request must not end the others
                self.last_error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._sessions.pop(slot, None)
                if result is not None and result.finish_reason != "cancelled" and not result.error:
                    self.finished += 1
                elif result is None or result.error:
                    self.failed += 1
                    self.last_error = (result.error if result is not None else None) or self.last_error
                    stop.wait(_RETRY_S)
            n += 1


class EngineLoad:
    """The load an explorer or a text run puts on its own engine: background requests and the served API."""

    def __init__(self, engine: Engine, options: LoadOptions, like: GenerationRequest) -> None:
        """Start serving now when asked (LoadError, one line, when the port is taken); the
        background requests start with `begin`."""
        self.options = options
        self.background = BackgroundLoad(engine, options.background, like)
        self.server: BackgroundServer | None = None
        if options.serve_port is not None:
            self.server = serve_engine(engine, options.serve_port)

    @property
    def note(self) -> LoadNote:
        """What the screen says of it."""
        return LoadNote(self.options.background, self.server.url if self.server is not None else None)

    def follow(self, event: Event) -> None:
        """Follow the user's request: start the background requests once it has decoded SOLO_STEPS
        steps alone, stop them when it ends."""
        if isinstance(event, TokenEvent) and event.index >= SOLO_STEPS:
            self.begin()
        elif isinstance(event, DoneEvent):
            self.end()

    def begin(self) -> None:
        """Background requests run (again; nothing changes while they run)."""
        self.background.start()

    def end(self, wait: bool = False) -> None:
        """The user's request ended: background requests stop (the API keeps serving)."""
        self.background.stop(wait=wait)

    def close(self) -> None:
        """Stop everything: the background requests, then the server (its open streams are cancelled)."""
        self.background.stop()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> EngineLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_engine(engine: Engine, port: int, host: str = SERVE_HOST) -> BackgroundServer:
    """Serve the OpenAI API from `engine` on a thread of its own (`reqscope.serve`'s app, keyless, loopback only)."""
    from reqscope.serve.app import ServeConfig, build_app
    from reqscope.serve.gateway import GatewayConfig
    from reqscope.serve.runner import start_in_thread

    config = ServeConfig(model_name=engine.model_dir.name, gateway=GatewayConfig(loopback_hosts_only=True))
    try:
        return start_in_thread(build_app(engine, config), host, port)
    except OSError as exc:
        raise LoadError(port_error(host, port, exc)) from None

