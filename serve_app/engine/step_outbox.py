"""The engine replica's end of the step channel: one message per engine step per caller.

A streamed request that names a ``reply_to`` inbox gets its steps sent there instead of as
Serve handle messages. Every step produced in one turn of the event loop (vLLM's output
handler wakes all of a step's requests together) is queued, and one ``call_soon`` flush sends
one frame per caller with all of them: at c=64 one message instead of 64, where a Serve
handle message costs a serialization and a gRPC write on each side.

Sends never block: ZeroMQ queues up to ``SEND_HWM`` frames per caller while it connects or
catches up; past that (a caller that died) frames are dropped, counted and logged once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from serve_app.hops import EngineStep, encode_step

logger = logging.getLogger("serve_app.engine")
SEND_HWM = 10_000  # Frames queued per caller before new ones are dropped.
IDLE_CLOSE_S = 600.0  # A caller's socket unused this long is closed (its router left).


class StepOutbox:
    def __init__(self) -> None:
        import zmq

        self._zmq = zmq
        self._context: Any = zmq.Context.instance()
        self._sockets: dict[str, tuple[Any, float]] = {}
        self._pending: dict[str, list[list[Any]]] = {}
        self._flush_scheduled = False
        self.frames = 0  # Frames sent (tests, debugging: frames < steps means batching).
        self.steps = 0
        self.dropped = 0
        self._swept_at = time.monotonic()

    def send(self, address: str, key: str, step: EngineStep) -> None:
        """Queue ``step`` for ``address``; it leaves with this loop turn's other steps."""
        self._pending.setdefault(address, []).append([key, encode_step(step)])
        self.steps += 1
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        import msgpack

        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        now = time.monotonic()
        for address, items in pending.items():
            try:
                self._socket(address, now).send(msgpack.packb(items), self._zmq.NOBLOCK)
                self.frames += 1
            except self._zmq.Again:
                if not self.dropped:
                    logger.warning("Step channel to %s is full (caller gone?): dropping", address)
                self.dropped += len(items)
        self._close_idle(now)

    def _socket(self, address: str, now: float) -> Any:
        found = self._sockets.get(address)
        if found is None:
            socket = self._context.socket(self._zmq.PUSH)
            socket.setsockopt(self._zmq.SNDHWM, SEND_HWM)
            socket.setsockopt(self._zmq.LINGER, 0)
            socket.connect(address)
            found = (socket, now)
        self._sockets[address] = (found[0], now)
        return found[0]

    def _close_idle(self, now: float) -> None:
        if now - self._swept_at < 60:
            return
        self._swept_at = now
        for address, (socket, used) in list(self._sockets.items()):
            if now - used > IDLE_CLOSE_S:
                socket.close()
                del self._sockets[address]

    def close(self) -> None:
        for socket, _ in self._sockets.values():
            socket.close()
        self._sockets.clear()
