"""Server-sent events: the event lines, and keep-alive comments while a stream waits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # A comment line: SSE clients (the openai SDK) skip it.


async def with_keepalive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """``events``, plus an SSE comment whenever none came for about ``interval_s`` (0: never),
    so proxies and load balancers with idle timeouts keep a waiting stream open.

    One pump task per stream and one timer every ``interval_s / 2``: nothing per event but a
    bounded queue hand-off (this runs once per engine step of every stream). The queue's
    bound is the backpressure on a client that reads slowly."""
    if interval_s <= 0:
        async for event in events:
            yield event
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | BaseException | None] = asyncio.Queue(_KEEPALIVE_BUFFER)
    last = loop.time()
    timer: asyncio.TimerHandle | None = None

    async def pump() -> None:
        nonlocal last
        try:
            async for event in events:
                await queue.put(event)
                last = loop.time()
        except Exception as exc:  # Surfaces on the consumer side, where it is handled.
            await queue.put(exc)
            return
        await queue.put(None)

    def tick() -> None:
        nonlocal last, timer
        if loop.time() - last >= interval_s and queue.empty():
            queue.put_nowait(SSE_KEEPALIVE)
            last = loop.time()
        timer = loop.call_later(interval_s / 2, tick)

    task = asyncio.ensure_future(pump())
    timer = loop.call_later(interval_s / 2, tick)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if timer is not None:
            timer.cancel()
        if not task.done():  # The client left mid-stream: stop the engine request too.
            task.cancel()
        with contextlib.suppress(BaseException):
            await task


_KEEPALIVE_BUFFER = 16  # Events a slow client may lag behind before the engine stream waits.
