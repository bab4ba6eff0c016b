"""Weighted fair admission of tenants (API keys) to one engine's sequence slots, by tokens.

vLLM serves its waiting queue first come, first served (within a priority): one key's 500
concurrent streams take every slot from a key that sends one request a minute. The engine
replica admits requests to vLLM through this gate instead: while slots are free a request starts
at once (a key alone may use the whole engine); once they run out, a freed slot goes to the
waiting tenant that has received the fewest tokens per unit of weight.

What a request costs: its prompt tokens when admitted (the prefill it causes), then its output
tokens as they are generated. Not prompt + max_tokens up front: max_tokens is an upper bound,
often the rest of the context window, so an up-front charge would punish keys that leave it
unset, and its refund arrives only when the request ends; the engine sees every generated token
anyway, so counters are exact at every admission and an aborted request costs what it used.

Counters are virtual token counters (as in VTC, Sheng et al., OSDI '24): ``served / weight``
per tenant. A tenant that becomes active (nothing waiting or running) is lifted to the
system's virtual time, the smallest counter of the tenants already active (never lowered), so
idle time is not saved up as credit and a newcomer does not lock out the others.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(eq=False)
class Ticket:
    """One request: who, at which vLLM priority, how many sequences (n) and prompt tokens."""

    tenant: str
    priority: int = 0
    seqs: int = 1
    prompt_tokens: int = 0
    seq: int = 0  # Arrival order (set by the queue).
    admitted: bool = False
    future: asyncio.Future[None] | None = field(default=None, repr=False)


class FairQueue:
    """The pure policy (no I/O, no clock): waiting tickets, counters, the next to admit."""

    def __init__(self, weights: Mapping[str, float], default_weight: float = 1.0) -> None:
        self._weights = dict(weights)
        self._default = default_weight
        self.counters: dict[str, float] = {}
        self.virtual_time = 0.0  # Never decreases.
        self._waiting: dict[str, list[tuple[int, int, Ticket]]] = {}
        self.running: Counter[str] = Counter()
        self._arrivals = itertools.count()

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default)

    @property
    def waiting(self) -> int:
        return sum(len(heap) for heap in self._waiting.values())

    def push(self, ticket: Ticket) -> None:
        if not self._active(ticket.tenant):
            floor = self._advance()
            self.counters[ticket.tenant] = max(self.counters.get(ticket.tenant, 0.0), floor)
        ticket.seq = next(self._arrivals)
        heap = self._waiting.setdefault(ticket.tenant, [])
        heapq.heappush(heap, (ticket.priority, ticket.seq, ticket))

    def peek(self) -> Ticket | None:
        """The next ticket in fair order: the lowest priority waiting anywhere, then the tenant
        with the smallest counter, then the one running fewer requests (a newcomer, lifted level
        with the others, goes first), then arrival order."""
        best: tuple[int, float, int, int] | None = None
        chosen: Ticket | None = None
        for tenant, heap in self._waiting.items():
            priority, seq, ticket = heap[0]
            key = (priority, self.counters[tenant], self.running[tenant], seq)
            if best is None or key < best:
                best, chosen = key, ticket
        return chosen

    def admit(self, ticket: Ticket) -> None:
        """Take ``ticket`` out of the queue into the running set; charge its prompt."""
        heap = self._waiting[ticket.tenant]
        heap.remove((ticket.priority, ticket.seq, ticket))
        heapq.heapify(heap)
        if not heap:
            del self._waiting[ticket.tenant]
        self.running[ticket.tenant] += 1
        ticket.admitted = True
        self.charge(ticket.tenant, ticket.prompt_tokens)

    def remove(self, ticket: Ticket) -> None:
        """A waiting request went away before admission."""
        heap = self._waiting.get(ticket.tenant, [])
        if (ticket.priority, ticket.seq, ticket) in heap:
            heap.remove((ticket.priority, ticket.seq, ticket))
            heapq.heapify(heap)
        if not heap:
            self._waiting.pop(ticket.tenant, None)

    def charge(self, tenant: str, tokens: int) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weight(tenant)

    def finish(self, ticket: Ticket) -> None:
        self.running[ticket.tenant] -= 1
        if self.running[ticket.tenant] <= 0:
            del self.running[ticket.tenant]

    def _active(self, tenant: str) -> bool:
        return tenant in self._waiting or tenant in self.running

    def _advance(self) -> float:
        active = [self.counters[t] for t in {*self._waiting, *self.running}]
        if active:
            self.virtual_time = max(self.virtual_time, min(active))
        return self.virtual_time


class FairShareGate:
    """At most ``limit + ahead`` sequences in vLLM; waiting requests are admitted in
    ``FairQueue`` order as sequences finish. A request larger than that runs when the engine is
    empty.

    ``ahead``: a few sequences beyond vLLM's slots wait in vLLM's own queue, so a slot that frees
    is refilled in the same engine step instead of after a round trip through this gate; they
    were admitted in fair order, so they only delay fairness by that many requests.
    """

    def __init__(self, limit: int, queue: FairQueue, ahead: int = 0) -> None:
        if limit < 1 or ahead < 0:
            raise ValueError("limit must be at least 1 and ahead at least 0")
        self.limit = limit + ahead
        self.queue = queue
        self.running_seqs = 0

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    @asynccontextmanager
    async def slot(
        self, tenant: str, priority: int = 0, seqs: int = 1, prompt_tokens: int = 0
    ) -> AsyncIterator[Callable[[int], None]]:
        """Entered once admitted; yields ``charge(tokens)`` for the tokens generated."""
        ticket = Ticket(tenant, priority, max(1, seqs), prompt_tokens)
        self.queue.push(ticket)
        self._dispatch()
        if not ticket.admitted:
            ticket.future = asyncio.get_running_loop().create_future()
            try:
                await ticket.future
            except BaseException:
                if ticket.admitted:  # Admitted and cancelled at once: give the slot back.
                    self._release(ticket)
                else:
                    self.queue.remove(ticket)
                raise
        try:
            yield lambda tokens: self.queue.charge(tenant, tokens)
        finally:
            self._release(ticket)

    def _release(self, ticket: Ticket) -> None:
        self.running_seqs -= ticket.seqs
        self.queue.finish(ticket)
        self._dispatch()

    def _dispatch(self) -> None:
        while (ticket := self.queue.peek()) is not None:
            fits = self.running_seqs + ticket.seqs <= self.limit or self.running_seqs == 0
            if not fits:
                return
            self.queue.admit(ticket)
            self.running_seqs += ticket.seqs
            if ticket.future is not None and not ticket.future.done():
                ticket.future.set_result(None)
