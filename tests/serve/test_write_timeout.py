"""A streamed write that a client never takes in: the connection is aborted after the write timeout.

Filling a loopback socket's buffers from a test is not reliable (the kernel grows the send
buffer to several MiB), so the write is a fake that never completes, as aiohttp's does while
the buffers are full.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from reqscope.serve.app import write_or_drop


class Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class Request:
    def __init__(self) -> None:
        self.transport = Transport()


class Response:
    """A response whose writes wait until `taken` is set (a client that reads)."""

    def __init__(self, reads: bool) -> None:
        self.reads = reads
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if not self.reads:
            await asyncio.Event().wait()  # the buffers stay full
        self.written.append(data)


def test_a_write_the_client_never_takes_is_dropped_after_the_timeout():
    request, response = Request(), Response(reads=False)
    started = time.monotonic()
    with pytest.raises(ConnectionResetError, match="read nothing for 0.2 s"):
        asyncio.run(write_or_drop(request, response, b"data: {}\n\n", 0.2))
    assert 0.15 <= time.monotonic() - started < 2.0
    assert request.transport.aborted and response.written == []


def test_a_write_the_client_takes_goes_through():
    request, response = Request(), Response(reads=True)
    asyncio.run(write_or_drop(request, response, b"data: {}\n\n", 0.2))
    assert response.written == [b"data: {}\n\n"] and not request.transport.aborted
