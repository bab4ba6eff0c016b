"""Batch API lines in the engine: a line is completed once, even if it is sent twice.

A batch line's request id is derived from its batch and input line (``hops.batch_line_request_id``).
When a coordinator dies with lines in flight and another takes the batch over, it sends those
lines again. Depending on the transport, the dead caller's engine calls were cancelled (then
vLLM aborted them: nothing completed) or they run on. So a line sent again while it runs joins
the running request, and one that finished within ``replay_s`` gets its recorded result: the
engine completes each line once. Per batch, the engine counts what it submitted, completed,
joined and replayed (``counts(batch_id)``), which tests and operators read.

Only non-streaming requests with a batch line id take this path; a line is aborted as before
when its last caller goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from serve_app.errors import APIError
from serve_app.hops import EngineRequest, EngineStep, batch_of_request

Generate = Callable[[EngineRequest], AsyncIterator[EngineStep]]
KEPT_BATCHES = 64  # Batches whose counts are kept.


@dataclass
class _Running:
    task: asyncio.Task[list[EngineStep]]
    callers: int = 0


@dataclass
class BatchLineCounts:
    """What the engine did with one batch's lines."""

    submitted: int = 0  # Sent to vLLM.
    completed: int = 0  # Finished by vLLM.
    joined: int = 0  # Sent again while running: joined the running request.
    replayed: int = 0  # Sent again after finishing: answered from the kept result.
    distinct: set[str] = field(default_factory=set)  # Request ids completed.

    def as_dict(self) -> dict[str, int]:
        return {
            "submitted": self.submitted,
            "completed": self.completed,
            "distinct": len(self.distinct),
            "joined": self.joined,
            "replayed": self.replayed,
        }


class BatchLines:
    def __init__(
        self, replay_s: float, max_kept: int = 50_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.replay_s, self.max_kept, self._clock = replay_s, max_kept, clock
        self._running: dict[str, _Running] = {}
        self._finished: OrderedDict[str, tuple[float, list[EngineStep]]] = OrderedDict()
        self._counts: OrderedDict[str, BatchLineCounts] = OrderedDict()

    def counts(self, batch_id: str) -> dict[str, int]:
        found = self._counts.get(batch_id)
        return (found or BatchLineCounts()).as_dict()

    def _count(self, batch_id: str) -> BatchLineCounts:
        """The counts of a batch, the most recent KEPT_BATCHES batches kept."""
        found = self._counts.pop(batch_id, None) or BatchLineCounts()
        self._counts[batch_id] = found
        while len(self._counts) > KEPT_BATCHES:
            self._counts.popitem(last=False)
        return found

    async def generate(self, request: EngineRequest, run: Generate) -> AsyncIterator[EngineStep]:
        batch = batch_of_request(request.request_id)
        if batch is None or request.stream:
            async for step in run(request):
                yield step
            return
        for step in await self._once(batch, request, run):
            yield step

    async def _once(self, batch: str, request: EngineRequest, run: Generate) -> list[EngineStep]:
        rid = request.request_id
        self._forget_old()
        while (running := self._running.get(rid)) is not None and running.task.cancelling():
            # Its last caller left just now and vLLM is aborting it: joining would share its
            # cancellation. Once it is gone, this line runs afresh.
            await asyncio.wait({running.task})
        if (kept := self._finished.get(rid)) is not None:
            self._count(batch).replayed += 1
            return kept[1]
        if running is None:
            task = asyncio.create_task(self._collect(batch, request, run))
            running = self._running[rid] = _Running(task)
        else:
            self._count(batch).joined += 1
        running.callers += 1
        try:
            return await asyncio.shield(running.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is None or current.cancelling() or not running.task.cancelled():
                raise
            # Aborted under this caller (never by it): the caller may send it again.
            raise APIError(
                f"Batch line {rid} was aborted in the engine; retry.",
                status=503,
                type="server_error",
                code="backend_unavailable",
            ) from None
        finally:
            running.callers -= 1
            if running.callers == 0 and not running.task.done():
                running.task.cancel()  # Nobody waits for it any more: vLLM aborts it.

    async def _collect(self, batch: str, request: EngineRequest, run: Generate) -> list[EngineStep]:
        rid = request.request_id
        self._count(batch).submitted += 1
        try:
            steps = [step async for step in run(request)]
        finally:
            self._running.pop(rid, None)
        if steps and steps[-1].finished:
            counts = self._count(batch)
            counts.completed += 1
            counts.distinct.add(rid)
            self._finished[rid] = (self._clock() + self.replay_s, steps)
            while len(self._finished) > self.max_kept:
                self._finished.popitem(last=False)
        return steps

    def _forget_old(self) -> None:
        now = self._clock()
        while self._finished:
            rid, (until, _) = next(iter(self._finished.items()))
            if until > now:
                return
            del self._finished[rid]
