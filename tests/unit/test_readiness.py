"""Readiness from cached state (serve_app.ingress.readiness) with a fake probe and clock."""

from __future__ import annotations

import asyncio

from serve_app.ingress.readiness import Readiness


def test_cached_single_flight_and_bounded() -> None:
    async def scenario() -> None:
        now = [0.0]
        calls: list[float] = []
        verdicts = [True, False]
        gate = asyncio.Event()
        gate.set()

        async def probe() -> bool:
            calls.append(now[0])
            await gate.wait()
            return verdicts[min(len(calls) - 1, len(verdicts) - 1)]

        readiness = Readiness(probe, ttl_s=2, timeout_s=0.05, clock=lambda: now[0])
        # Many probes at once: one look at the controller.
        assert await asyncio.gather(*(readiness.ready() for _ in range(10))) == [True] * 10
        assert len(calls) == 1
        now[0] = 1.9  # Within the TTL: the cached verdict.
        assert await readiness.ready() and len(calls) == 1
        now[0] = 2.5  # Stale: looked again.
        assert not await readiness.ready() and len(calls) == 2
        # A controller that does not answer in time: not ready, and the look goes on.
        gate.clear()
        now[0] = 5.0
        verdicts[:] = [True]
        assert not await readiness.ready()
        assert not await readiness.ready() and len(calls) == 3  # Still the same look.
        gate.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert await readiness.ready() and len(calls) == 3

    asyncio.run(scenario())


def test_a_failing_probe_is_not_ready() -> None:
    async def probe() -> bool:
        raise ConnectionError("controller gone")

    assert not asyncio.run(Readiness(probe, ttl_s=2, timeout_s=1).ready())
