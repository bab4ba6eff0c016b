"""Engine replicas that went away under calls of this process, told to those calls.

A call to an engine replica learns of the replica's death from its transport, but not always:
a hung replica (stopped, wedged, its node unreachable) keeps its connections open and answers
nothing, and its calls would wait out the whole request timeout although Serve has long since
found it unhealthy and replaced it. The request router (``serve_router``) knows both where each
call went and when a replica leaves the routing set; a call watches its request id here and is
told when its replica is lost, so a call with no token yet is resubmitted elsewhere
(``ingress.handles``) as if the transport had failed it.

One instance per process (``ENGINE_DEPARTURES``): Serve runs the request router on its own
event loop, which may be another thread's, so signals cross loops thread-safely.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

LOST_REMEMBERED = 256  # Lost replica ids kept, for calls routed there just before the news.


@dataclass(eq=False)
class _Watch:
    loop: asyncio.AbstractEventLoop
    lost: asyncio.Future[None]
    replica: str | None = field(default=None)


class EngineDepartures:
    """Which engine replica each watched call went to, and a signal per call when it is lost."""

    def __init__(self) -> None:
        self._watches: dict[str, list[_Watch]] = {}  # By engine request id.
        self._lost: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # Calls' loop and the request router's may differ.

    @contextlib.contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Future[None]]:
        """A future, on the running loop, that resolves if the replica this call is routed to
        is lost; watched until the block ends."""
        loop = asyncio.get_running_loop()
        watch = _Watch(loop, loop.create_future())
        with self._lock:
            self._watches.setdefault(request_id, []).append(watch)
        try:
            yield watch.lost
        finally:
            with self._lock:
                watches = self._watches.get(request_id, [])
                if watch in watches:
                    watches.remove(watch)
                if not watches:
                    self._watches.pop(request_id, None)

    def routed(self, request_id: str, replica: str) -> None:
        """The call ``request_id`` was accepted by ``replica``."""
        with self._lock:
            for watch in self._watches.get(request_id, ()):
                watch.replica = replica
                if replica in self._lost:
                    self._tell(watch)

    def watching(self, replica: str) -> bool:
        """Whether a watched call is on ``replica``."""
        with self._lock:
            return any(w.replica == replica for ws in self._watches.values() for w in ws)

    def lost(self, replica: str) -> None:
        """``replica`` is dead or hung: its watched calls are told."""
        with self._lock:
            self._lost[replica] = None
            self._lost.move_to_end(replica)
            while len(self._lost) > LOST_REMEMBERED:
                self._lost.popitem(last=False)
            for watches in self._watches.values():
                for watch in watches:
                    if watch.replica == replica:
                        self._tell(watch)

    @staticmethod
    def _tell(watch: _Watch) -> None:
        def resolve() -> None:
            if not watch.lost.done():
                watch.lost.set_result(None)

        with contextlib.suppress(RuntimeError):  # Its loop closed: nobody is waiting.
            watch.loop.call_soon_threadsafe(resolve)


ENGINE_DEPARTURES = EngineDepartures()
