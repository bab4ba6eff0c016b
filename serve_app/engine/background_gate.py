"""Keep engine slots free for interactive traffic while background work floods the engine.

vLLM's priority scheduler orders its waiting queue and preempts on KV-cache pressure, but it
never preempts a running sequence for a free *slot*: once background requests fill all
``max_num_seqs``, an interactive request waits for one of them to finish (seconds). The gate
admits background requests (priority > 0) to vLLM only while fewer than ``limit`` of them run,
so the remaining slots are always open to priority-0 requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BackgroundGate:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._slots: asyncio.Semaphore | None = None  # Made on first use, inside the loop.
        self.waiting = 0  # Background requests held back here (part of the queue depth).

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        """Entered when the request may go to vLLM; interactive requests never wait."""
        if priority <= 0:
            yield
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._slots.release()
