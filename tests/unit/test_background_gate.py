"""BackgroundGate: background requests never take the slots kept for interactive ones."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config import EngineConfig
from serve_app.engine.background_gate import BackgroundGate


async def _hold(
    gate: BackgroundGate, priority: int, running: list[int], release: asyncio.Event
) -> None:
    async with gate.slot(priority):
        running.append(priority)
        await release.wait()


def test_background_waits_beyond_limit_and_interactive_never_waits() -> None:
    async def scenario() -> None:
        gate, release = BackgroundGate(2), asyncio.Event()
        running: list[int] = []
        tasks = [asyncio.create_task(_hold(gate, 100, running, release)) for _ in range(5)]
        await asyncio.sleep(0.01)
        assert running == [100, 100] and gate.waiting == 3
        interactive = [asyncio.create_task(_hold(gate, 0, running, release)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert running.count(0) == 3  # Admitted at once, the background queue notwithstanding.
        release.set()
        await asyncio.gather(*tasks, *interactive)
        assert running.count(100) == 5 and gate.waiting == 0

    asyncio.run(scenario())


def test_cancelled_waiter_and_failing_holder_free_their_places() -> None:
    async def scenario() -> None:
        gate = BackgroundGate(1)
        holder_may_fail = asyncio.Event()

        async def failing() -> None:
            async with gate.slot(5):
                await holder_may_fail.wait()
                raise RuntimeError("engine error")

        holder = asyncio.create_task(failing())
        await asyncio.sleep(0.01)
        waiter = asyncio.create_task(_hold(gate, 5, [], asyncio.Event()))
        await asyncio.sleep(0.01)
        assert gate.waiting == 1
        waiter.cancel()  # The client went away while queued.
        await asyncio.gather(waiter, return_exceptions=True)
        assert gate.waiting == 0
        holder_may_fail.set()
        with pytest.raises(RuntimeError):
            await holder
        async with asyncio.timeout(1):  # The slot came back despite the error.
            async with gate.slot(5):
                pass

    asyncio.run(scenario())


def test_limit_must_be_positive_and_config_documents_the_reserve() -> None:
    with pytest.raises(ValueError):
        BackgroundGate(0)
    field = EngineConfig.model_fields["interactive_reserved_seqs"]
    assert field.default == 8 and field.description
    with pytest.raises(ValueError):
        EngineConfig(interactive_reserved_seqs=-1)
