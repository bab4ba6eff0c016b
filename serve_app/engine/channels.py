"""Output channels: one message per engine step to each caller, for all its streams.

A streamed request's own handle call would carry one Serve message per token; with many
streams in flight that per-message cost (pickling, gRPC, Serve's generator bookkeeping on both
sides) is most of the frontend's CPU per token. A caller (a Router replica) instead keeps one
long-lived streaming call per engine replica, its channel; the steps of every request it
streams on that replica are buffered in the channel's outbox and sent together, one message per
flush (in practice one per engine step). The request's own call stays open for its lifetime, so
Serve's routing, queue lengths, cancellation and failure detection work as before; it carries
only ``OnChannel`` at the start.

A channel with no request of its caller in flight here for ``idle_close_s`` ends itself (a
request streaming on its own call counts: the one that offered the channel keeps it open): a
draining replica is not held up by it, and the caller opens a new one when it next streams there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

from serve_app.errors import ErrorInfo
from serve_app.hops import EngineStep

ChannelItem = tuple[str, EngineStep | ErrorInfo]
IDLE_CLOSE_S = 2.0
MAX_CHANNELS = 1024  # Bounds what callers (router replicas) can make a replica hold.


class Outbox:
    """One caller's buffered steps on this replica."""

    def __init__(self, busy: Callable[[], bool] = lambda: False) -> None:
        """``busy()``: whether the caller has a request streaming here on its own call."""
        self.items: list[ChannelItem] = []
        self.in_flight = 0  # Requests streaming through this outbox now.
        self.busy = busy
        self.closed = False
        self.idle_since = time.monotonic()
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: EngineStep | ErrorInfo) -> None:
        self.items.append((request_id, item))
        self._ready.set()

    def begin(self) -> None:
        self.in_flight += 1

    def end(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.touch()

    def touch(self) -> None:
        """Restart the idle clock (a request of the caller ended)."""
        self.idle_since = time.monotonic()
        self._ready.set()  # Wake the flusher to start its idle clock.

    def idle(self) -> bool:
        return not self.in_flight and not self.busy()

    async def batches(self, idle_close_s: float) -> AsyncIterator[list[ChannelItem]]:
        """Everything put since the last batch, as one list, until idle for ``idle_close_s``."""
        try:
            while True:
                if not self.items:
                    if self.idle() and time.monotonic() - self.idle_since >= idle_close_s:
                        return
                    self._ready.clear()
                    try:
                        await asyncio.wait_for(self._ready.wait(), idle_close_s)
                    except TimeoutError:
                        continue
                    # Let every request woken by the same engine step put its output first.
                    await asyncio.sleep(0)
                if self.items:
                    batch, self.items = self.items, []
                    yield batch
        finally:
            self.closed = True


class OutputChannels:
    """The open channels of one engine replica, by caller id."""

    def __init__(self, idle_close_s: float = IDLE_CLOSE_S) -> None:
        self.idle_close_s = idle_close_s
        self._outboxes: dict[str, Outbox] = {}
        self._direct: dict[str, int] = {}  # Requests streaming on their own call, by caller.

    def outbox(self, caller: str | None) -> Outbox | None:
        """The open outbox of ``caller``, if any."""
        if caller is None:
            return None
        outbox = self._outboxes.get(caller)
        return outbox if outbox is not None and not outbox.closed else None

    async def open(self, caller: str) -> AsyncIterator[list[ChannelItem]]:
        """The channel of ``caller``: batches of (request id, step or error) until idle. A
        second open by the same caller replaces the first (its old call was lost)."""
        if len(self._outboxes) >= MAX_CHANNELS and caller not in self._outboxes:
            return
        old = self._outboxes.get(caller)
        if old is not None:
            old.closed = True
        outbox = self._outboxes[caller] = Outbox(lambda: self._direct.get(caller, 0) > 0)
        try:
            async for batch in outbox.batches(self.idle_close_s):
                yield batch
        finally:
            outbox.closed = True
            if self._outboxes.get(caller) is outbox:
                del self._outboxes[caller]

    @contextlib.contextmanager
    def streaming_directly(self, caller: str) -> Iterator[None]:
        """A request of ``caller`` streaming on its own call: its channel here stays open."""
        self._direct[caller] = self._direct.get(caller, 0) + 1
        try:
            yield
        finally:
            self._direct[caller] -= 1
            if not self._direct[caller]:
                del self._direct[caller]
            if (outbox := self.outbox(caller)) is not None:
                outbox.touch()

    def __len__(self) -> int:
        return len(self._outboxes)


async def through_outbox(
    outbox: Outbox, request_id: str, steps: AsyncIterator[EngineStep | ErrorInfo]
) -> None:
    """Put each item of ``steps`` in ``outbox`` until the last. Stops early when the channel is
    gone (``steps`` closed: the engine aborts the request): its caller fails the request."""
    try:
        async for step in steps:
            if outbox.closed:
                return
            outbox.put(request_id, step)
    finally:
        if (aclose := getattr(steps, "aclose", None)) is not None:
            await aclose()
