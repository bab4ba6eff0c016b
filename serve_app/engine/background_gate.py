"""Keep engine slots free for interactive traffic while background work floods the engine.

vLLM's priority scheduler orders its waiting queue and preempts on KV-cache pressure, but it
never preempts a running sequence for a free *slot*: once background requests fill all
``max_num_seqs``, an interactive request waits for one of them to finish (seconds). The gate
admits background requests (priority > 0) to vLLM only while their sequences (``n`` each) fit
in ``limit``, so the remaining slots are always open to priority-0 requests.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BackgroundGate:
    """At most ``limit`` background *sequences* in vLLM: a request with ``n`` choices counts
    ``n`` (capped at ``limit``, so it can always run alone). First come, first admitted: a
    wide request waiting for room is not overtaken by narrow ones behind it."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.running = 0  # Background sequences admitted to vLLM.
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Background requests held back here (part of the queue depth)."""
        return len(self._queue)

    @asynccontextmanager
    async def slot(self, priority: int, seqs: int = 1) -> AsyncIterator[None]:
        """Entered when the request may go to vLLM; interactive requests never wait."""
        if priority <= 0:
            yield
            return
        need = min(max(1, seqs), self.limit)
        if self._queue or self.running + need > self.limit:
            admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (need, admitted)
            self._queue.append(entry)
            try:
                await admitted
            except asyncio.CancelledError:
                if admitted.done() and not admitted.cancelled():
                    self.running -= need  # Admitted just as it was cancelled: give it back.
                else:
                    self._queue.remove(entry)
                self._admit()  # Whoever it held up may go now.
                raise
        else:
            self.running += need
        try:
            yield
        finally:
            self.running -= need
            self._admit()

    def _admit(self) -> None:
        while self._queue and self.running + self._queue[0][0] <= self.limit:
            need, admitted = self._queue.popleft()
            self.running += need
            admitted.set_result(None)
