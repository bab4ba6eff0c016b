"""A caller's end of the step channel: one socket per process, all its streams' steps.

Each process that streams from engines (a Router replica, the batch coordinator) binds one
ZeroMQ PULL socket on its node's address. A streamed engine request names it (``reply_to``)
with a fresh random key per attempt (``reply_key``); the engine replica sends the request's
steps there, batched with every other stream of this process on that replica. Frames are
msgpack data only, and a step whose key is not registered (an attempt given up, a stranger)
is dropped, so a re-submitted stream never sees its first attempt's steps.

``ChanneledResponse`` merges the two paths of one call into what ``bounded_stream`` iterates:
steps from the inbox; errors, and the end, from the Serve handle call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

from serve_app.errors import APIError
from serve_app.hops import EngineStep, decode_step

logger = logging.getLogger("serve_app.graph.step_inbox")
MAX_FRAME_BYTES = 64 * 1024 * 1024
# After the engine's handle call ended, how long its last steps may still be on the way.
LAST_STEP_GRACE_S = 10.0


class StepInbox:
    def __init__(self, host: str) -> None:
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._receiver = asyncio.ensure_future(self._receive())

    def register(self) -> tuple[str, asyncio.Queue[Any]]:
        """A new key and the queue its steps arrive in."""
        key = secrets.token_hex(16)  # Unguessable: nobody else can write into the stream.
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[key] = queue
        return key, queue

    def unregister(self, key: str) -> None:
        self._streams.pop(key, None)

    async def _receive(self) -> None:
        import msgpack

        while True:
            frame = await self._socket.recv()
            try:
                for key, data in msgpack.unpackb(frame):
                    queue = self._streams.get(key)
                    if queue is not None:
                        queue.put_nowait(decode_step(data))
            except Exception:  # A malformed frame: nothing a stream could use.
                logger.exception("Step inbox: dropped a malformed frame")

    def close(self) -> None:
        self._receiver.cancel()
        self._socket.close()


_inbox: StepInbox | None = None


def inbox() -> StepInbox:
    """This process's inbox, bound on first use in the running event loop."""
    global _inbox
    if _inbox is None:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        _inbox = StepInbox(host)
    return _inbox


class ChanneledResponse:
    """One streaming handle call whose steps come over an inbox."""

    def __init__(self, response: Any, inbox: StepInbox, key: str, queue: asyncio.Queue[Any]):
        self._response, self._inbox, self._key, self._queue = response, inbox, key, queue
        self._pump: asyncio.Future[None] | None = None
        self._ended = False

    async def _fetch_future_result_async(self) -> Any:
        """Resolves once a replica accepted the call (``bounded_stream`` bounds the wait)."""
        assigned = getattr(self._response, "_fetch_future_result_async", None)
        return None if assigned is None else await assigned()

    def __aiter__(self) -> ChanneledResponse:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        if self._pump is None:
            self._pump = asyncio.ensure_future(self._drain_handle())
        item = await self._queue.get()
        if isinstance(item, EngineStep):
            if item.finished:  # The handle call ends by itself right after.
                self._end(stop_handle=False)
            return item
        self._end()
        if isinstance(item, BaseException):
            raise item
        return item  # An ErrorInfo from the engine: the stream's last item.

    async def _drain_handle(self) -> None:
        """The handle call carries errors (and steps, from an engine that streams them the
        old way); its end means the finished step is in the inbox or on its way."""
        try:
            async for item in self._response:
                self._queue.put_nowait(item)
        except BaseException as exc:
            self._queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if self._ended:
            return
        await asyncio.sleep(LAST_STEP_GRACE_S)
        self._queue.put_nowait(
            APIError(
                "The engine ended the stream but its last output never arrived; retry.",
                status=502,
                type="server_error",
                code="stream_incomplete",
            )
        )

    def _end(self, stop_handle: bool = True) -> None:
        self._ended = True
        self._inbox.unregister(self._key)
        if stop_handle and self._pump is not None and not self._pump.done():
            self._pump.cancel()

    def cancel(self) -> None:
        self._end()
        with contextlib.suppress(Exception):
            self._response.cancel()
