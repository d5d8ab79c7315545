"""The worker threads' inbox to the event loop: every item arrives, in order per queue, and items
that arrive together share one wake-up of the loop."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from reqscope.serve.engine_session import LoopInbox, inbox_of


def test_items_from_many_threads_arrive_in_order_per_queue():
    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        inbox = inbox_of(loop)
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(8)]

        def worker(i: int) -> None:
            for n in range(200):
                inbox.put(queues[i], n)  # type: ignore[arg-type]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        got = [[await q.get() for _ in range(200)] for q in queues]
        for t in threads:
            t.join()
        return got

    assert asyncio.run(main()) == [list(range(200))] * 8


def test_items_that_arrive_while_a_delivery_is_pending_share_it():
    async def main() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        inbox = LoopInbox(loop)
        queue: asyncio.Queue = asyncio.Queue()
        # The loop is busy in this coroutine, so the first item's delivery waits: the rest ride along.
        posting = [threading.Thread(target=inbox.put, args=(queue, n)) for n in range(8)]
        for t in posting:
            t.start()
            t.join()
        got = [await queue.get() for _ in range(8)]
        return wakeups, got

    wakeups, got = asyncio.run(main())
    assert got == list(range(8))
    assert wakeups == 1


def test_a_closed_loop_refuses_items():
    loop = asyncio.new_event_loop()
    inbox = inbox_of(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        inbox.put(asyncio.Queue(), 1)  # type: ignore[arg-type]


def test_a_loop_gone_takes_its_inbox_with_it():
    loop = asyncio.new_event_loop()
    inbox_of(loop)
    from reqscope.serve import engine_session

    count = len(engine_session._inboxes)
    loop.close()
    del loop
    gc.collect()
    assert len(engine_session._inboxes) == count - 1
