"""The router's side of the engine's output channels (``serve_app.engine.channels``).

A streamed engine call names this router's channel id. If its replica has the channel open,
the call's own stream carries only ``OnChannel`` and its steps arrive on the channel, in one
message per engine step for all of this router's streams there; the dispatcher here puts them
in each call's queue. Otherwise the call streams as before and says ``ChannelOffer``: the
router then opens a channel to that replica for the next requests.

``ChanneledCall`` looks to ``handles.bounded_stream`` like the handle's response generator
(assignment, items, cancel), so the bounds, resubmission and cancellation there apply
unchanged. Whatever goes wrong with a channel, a call on it never waits past its own bounds:
the channel's end fails the calls on it, as does its own call ending without a last step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from serve_app.errors import APIError, ErrorInfo, engine_unavailable
from serve_app.hops import ChannelOffer, ChannelOpen, EngineRequest, EngineStep, OnChannel

logger = logging.getLogger("serve_app.ingress")
OPEN_TIMEOUT_S = 5.0  # A channel not accepted by its replica within this long is given up.
RETRY_AFTER_S = 10.0  # After a channel failed to open, its replica is not tried again sooner.
# A call whose own stream ended waits this long for its last step on the channel.
LAST_STEP_GRACE_S = 5.0
_CALL_ENDED = object()


def channel_lost() -> APIError:
    return engine_unavailable("The engine replica's output channel was lost; retry shortly.")


class EngineChannels:
    """This router's channels to the replicas of one engine deployment, and the calls on them."""

    def __init__(self, engine: Any, on_joined: Callable[[], None] = lambda: None) -> None:
        """``engine``: the Engine deployment's streaming handle; ``on_joined()`` counts a
        stream whose steps come through a channel."""
        self.caller = uuid.uuid4().hex
        self._engine = engine
        self._on_joined = on_joined
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # By engine request id.
        self._via: dict[str, str] = {}  # Request id -> replica whose channel carries it.
        self._open: dict[str, asyncio.Task[None]] = {}  # By replica id.
        self._failed: dict[str, float] = {}  # Replica id -> when its channel failed to open.

    def call(self, request: EngineRequest) -> ChanneledCall:
        request = replace(request, channel=self.caller)
        return ChanneledCall(self, request.request_id, self._engine.generate.remote(request))

    def offer(self, replica: str) -> None:
        """Open a channel to ``replica`` unless one is open or recently failed to."""
        now = time.monotonic()
        for gone in [r for r, at in self._failed.items() if now - at >= RETRY_AFTER_S]:
            del self._failed[gone]  # Replicas come and go (autoscaling): forget old failures.
        if replica in self._open or replica in self._failed:
            return
        self._open[replica] = asyncio.create_task(self._run(replica))

    def register(self, request_id: str) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str, queue: asyncio.Queue[Any]) -> None:
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]
            self._via.pop(request_id, None)

    def joined(self, request_id: str, replica: str) -> None:
        """The call ``request_id`` streams through the channel to ``replica``."""
        queue = self._queues.get(request_id)
        if queue is None:
            return
        if replica in self._open:
            self._via[request_id] = replica
            self._on_joined()
        else:  # That channel ended before this call's first step was delivered.
            queue.put_nowait(channel_lost())

    async def _run(self, replica: str) -> None:
        received = False
        response = self._engine.open_channel.remote(ChannelOpen(self.caller, replica))
        try:
            # Private Serve API (2.60), as in bounded_stream: resolves once a replica took it.
            assigned = getattr(response, "_fetch_future_result_async", None)
            if assigned is not None:
                await asyncio.wait_for(assigned(), OPEN_TIMEOUT_S)
            async for batch in response:
                received = True
                for request_id, item in batch:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except Exception as exc:  # Replica gone, or never took the call: fail its calls.
            logger.info("Output channel to engine replica %s ended: %r", replica, exc)
        finally:
            if not received:  # Refused, never assigned, or another replica under that id.
                self._failed[replica] = time.monotonic()
            with contextlib.suppress(Exception):
                response.cancel()
            del self._open[replica]
            for request_id, via in list(self._via.items()):
                if via == replica:
                    del self._via[request_id]
                    if (queue := self._queues.get(request_id)) is not None:
                        queue.put_nowait(channel_lost())


class ChanneledCall:
    """One streamed engine call that may get its steps through a channel."""

    def __init__(self, channels: EngineChannels, request_id: str, response: Any) -> None:
        self._channels = channels
        self._request_id = request_id
        self._response = response
        self._queue = channels.register(request_id)
        self._on_channel = False
        self._call_ended = False
        self._done = False
        self._cancelled = False
        self._watcher: asyncio.Task[None] | None = None

    async def _fetch_future_result_async(self) -> Any:
        assigned = getattr(self._response, "_fetch_future_result_async", None)
        return await assigned() if assigned is not None else None

    def __aiter__(self) -> ChanneledCall:
        return self

    async def __anext__(self) -> Any:
        while not self._on_channel:
            try:
                item = await anext(self._response)
            except BaseException:
                self._finish()
                raise
            if isinstance(item, ChannelOffer):
                self._channels.offer(item.replica)
            elif isinstance(item, OnChannel):
                self._on_channel = True
                self._channels.joined(self._request_id, item.replica)
                self._watcher = asyncio.create_task(self._watch())
            else:
                return item
        if self._done:
            raise StopAsyncIteration
        if self._call_ended:
            try:
                item = await asyncio.wait_for(self._queue.get(), LAST_STEP_GRACE_S)
            except TimeoutError:
                item = channel_lost()
        else:
            item = await self._queue.get()
        if item is _CALL_ENDED:
            self._call_ended = True
            return await self.__anext__()
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if isinstance(item, ErrorInfo) or (isinstance(item, EngineStep) and item.finished):
            self._finish()
        return item

    async def _watch(self) -> None:
        """The call's own stream after OnChannel: its end, or its failure (replica gone)."""
        try:
            async for _ in self._response:
                pass
        except asyncio.CancelledError as exc:
            if self._cancelled:
                raise
            self._queue.put_nowait(exc)  # The callee's: bounded_stream reports it.
        except Exception as exc:
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(_CALL_ENDED)

    def _finish(self) -> None:
        self._done = True
        self._channels.unregister(self._request_id, self._queue)

    def cancel(self) -> None:
        self._cancelled = True
        self._finish()
        if self._watcher is not None:
            self._watcher.cancel()
        self._response.cancel()
