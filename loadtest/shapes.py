"""Load shapes over any ``send(body) -> RequestRecord``: closed loop, static batches, Poisson.

Every shape is bounded in count (the bodies given) and in time (``time_limit_s``: nothing new
is sent after it; what is in flight finishes). Open-loop arrivals are seeded and reproducible.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from loadtest.client import RequestRecord

Send = Callable[[dict[str, Any]], Awaitable[RequestRecord]]


async def _timed(
    send: Send, body: dict[str, Any], index: int, t0: float, out: list[RequestRecord]
) -> None:
    start = time.perf_counter()
    record = await send(body)
    record.start_s = start - t0
    record.index = index
    out.append(record)


async def closed_loop(
    send: Send, bodies: Sequence[dict[str, Any]], concurrency: int, time_limit_s: float = 3600
) -> tuple[list[RequestRecord], float]:
    """``concurrency`` workers, each sends its next body as soon as its last one finished."""
    records: list[RequestRecord] = []
    pending = list(range(len(bodies)))[::-1]
    t0 = time.perf_counter()

    async def worker() -> None:
        while pending and time.perf_counter() - t0 < time_limit_s:
            i = pending.pop()
            await _timed(send, bodies[i], i, t0, records)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0


def batch_plan(count: int, batch_size: int) -> list[list[int]]:
    """Indices of each static batch, in order: [[0..b-1], [b..2b-1], …, the remainder]."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    return [list(range(i, min(i + batch_size, count))) for i in range(0, count, batch_size)]


async def static_batches(
    send: Send, bodies: Sequence[dict[str, Any]], batch_size: int, time_limit_s: float = 3600
) -> tuple[list[RequestRecord], float]:
    """Send a batch, wait for all of it, then the next (the pre-continuous-batching way)."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    for batch in batch_plan(len(bodies), batch_size):
        if time.perf_counter() - t0 >= time_limit_s:
            break
        await asyncio.gather(*(_timed(send, bodies[i], i, t0, records) for i in batch))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0


def poisson_arrivals(
    rate: float, count: int, seed: int, time_limit_s: float = float("inf")
) -> list[float]:
    """Send offsets (s) of a Poisson process at ``rate`` req/s: at most ``count``, all before
    ``time_limit_s``. Same seed, same offsets."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    while len(offsets) < count:
        t += rng.expovariate(rate)
        if t >= time_limit_s:
            break
        offsets.append(t)
    return offsets


async def open_loop(
    send: Send,
    bodies: Sequence[dict[str, Any]],
    rate: float,
    seed: int = 0,
    time_limit_s: float = 3600,
) -> tuple[list[RequestRecord], float]:
    """Send at Poisson arrival times regardless of how many are in flight."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    tasks = []
    for i, offset in enumerate(poisson_arrivals(rate, len(bodies), seed, time_limit_s)):
        delay = offset - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_timed(send, bodies[i], i, t0, records)))
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index), time.perf_counter() - t0


async def run_shape(
    send: Send, bodies: Sequence[dict[str, Any]], shape: str, value: float, **kw: Any
) -> tuple[list[RequestRecord], float]:
    """Dispatch by name: ``closed`` (value = concurrency), ``static`` (value = batch size),
    ``poisson`` (value = rate req/s)."""
    if shape == "closed":
        return await closed_loop(send, bodies, int(value), kw.get("time_limit_s", 3600))
    if shape == "static":
        return await static_batches(send, bodies, int(value), kw.get("time_limit_s", 3600))
    if shape == "poisson":
        return await open_loop(send, bodies, value, kw.get("seed", 0), kw.get("time_limit_s", 3600))
    raise ValueError(f"unknown shape {shape!r} (closed, static, poisson)")
