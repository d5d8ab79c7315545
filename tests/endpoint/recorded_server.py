"""A loopback server that answers with pages a real server sent (tests/data/peer-pages-*.json).

`scripts/record_peer_pages` records them from vLLM, llama-server and llama-cpp-python's server:
by route, what a GET answered on the idle server, what the POSTs of one chat request answered, and
`polls`, the batch routes (`/metrics`, `/slots`) read together again and again while other clients
streamed. Served back here, each GET of a batch route takes the next poll's page (the last one
once they run out), so a poller sees the batch fill and empty as it did; everything served is
logged, so a test can compare what the client made of a page with the page itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from reqscope.serve.runner import start_in_thread

DATA = Path(__file__).resolve().parent.parent / "data"
CHUNK_GAP_S = 0.03  # between a replayed stream's chunks: long enough for several polls at 50 ms


@dataclass(frozen=True)
class RecordedPage:
    """One answer as recorded: its status, content type and body (a stream's payloads, one a line)."""

    status: int
    content_type: str
    body: str

    def json(self) -> object:
        """The body read as JSON."""
        return json.loads(self.body)


@dataclass(frozen=True)
class Recording:
    """Everything recorded from one server."""

    server: str  # which server, and how it was started
    get: dict[str, RecordedPage]
    post: dict[str, RecordedPage]
    polls: tuple[dict[str, RecordedPage], ...]

    def poll_pages(self, route: str) -> tuple[RecordedPage, ...]:
        """The pages of one batch route, poll by poll."""
        return tuple(poll[route] for poll in self.polls)


def load_recording(name: str) -> Recording:
    """tests/data/peer-pages-NAME.json."""
    raw = json.loads((DATA / f"peer-pages-{name}.json").read_text())

    def pages(by_route: dict) -> dict[str, RecordedPage]:
        return {route: RecordedPage(**page) for route, page in by_route.items()}

    return Recording(raw["server"], pages(raw["get"]), pages(raw["post"]), tuple(pages(p) for p in raw["polls"]))


@dataclass(frozen=True)
class Served:
    """One page the replay served: the route, and for a batch route which poll's page."""

    route: str
    poll: int | None
    page: RecordedPage


@dataclass
class Replay:
    """A running replay of one recording: its root URL and, in order, what it served."""

    recording: Recording
    root: str = ""
    served: list[Served] = field(default_factory=list)

    @property
    def v1(self) -> str:
        """The OpenAI base URL."""
        return self.root + "/v1"

    def served_polls(self, route: str) -> list[Served]:
        """The pages of a batch route served so far, in order."""
        return [s for s in self.served if s.route == route and s.poll is not None]


def _app(replay: Replay) -> web.Application:
    recording = replay.recording
    batch_routes = set(recording.polls[0]) if recording.polls else set()
    cursors = dict.fromkeys(batch_routes, 0)

    def respond(page: RecordedPage) -> web.Response:
        return web.Response(status=page.status, text=page.body, content_type=page.content_type or "text/plain")

    async def get(request: web.Request) -> web.Response:
        route = request.path
        if route in batch_routes:
            at = min(cursors[route], len(recording.polls) - 1)
            cursors[route] += 1
            page = recording.polls[at][route]
            replay.served.append(Served(route, at, page))
            return respond(page)
        page = recording.get.get(route)
        if page is None:
            raise web.HTTPNotFound()
        replay.served.append(Served(route, None, page))
        return respond(page)

    async def post(request: web.Request) -> web.StreamResponse:
        page = recording.post.get(request.path)
        if page is None:
            raise web.HTTPNotFound()
        replay.served.append(Served(request.path, None, page))
        if page.content_type != "text/event-stream":
            return respond(page)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for payload in page.body.splitlines():
            await response.write(b"data: " + payload.encode() + b"\n\n")
            await asyncio.sleep(CHUNK_GAP_S)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", get)
    app.router.add_route("POST", "/{tail:.*}", post)
    return app


@contextmanager
def replaying(name: str) -> Iterator[Replay]:
    """Serve the recording tests/data/peer-pages-NAME.json on a free loopback port while the block runs."""
    with serving(load_recording(name)) as replay:
        yield replay


@contextmanager
def serving(recording: Recording) -> Iterator[Replay]:
    """Serve `recording` on a free loopback port while the block runs."""
    replay = Replay(recording)
    server = start_in_thread(_app(replay), "127.0.0.1", 0)
    try:
        replay.root = server.url
        yield replay
    finally:
        server.stop()
