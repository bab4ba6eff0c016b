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


def test_choices_count_as_sequences_first_come_first_admitted() -> None:
    """A request with n choices takes n of the limit; a wide one waiting for room is not
    overtaken by narrow ones behind it; one wider than the limit still runs, alone."""

    async def scenario() -> None:
        gate, release = BackgroundGate(4), asyncio.Event()
        running: list[int] = []

        async def hold(seqs: int, done: asyncio.Event) -> None:
            async with gate.slot(100, seqs):
                running.append(seqs)
                await done.wait()
                running.remove(seqs)

        first_done = asyncio.Event()
        first = asyncio.create_task(hold(3, first_done))
        await asyncio.sleep(0.01)
        wide = asyncio.create_task(hold(2, release))
        narrow = asyncio.create_task(hold(1, release))
        await asyncio.sleep(0.01)
        assert running == [3] and gate.waiting == 2  # 1 would fit, but 2 came first.
        first_done.set()
        await asyncio.sleep(0.01)
        assert sorted(running) == [1, 2] and gate.running == 3
        release.set()
        await asyncio.gather(first, wide, narrow)
        assert gate.running == 0
        async with asyncio.timeout(1):
            async with gate.slot(100, 16):  # Wider than the limit: admitted when alone.
                assert gate.running == 4

    asyncio.run(scenario())


def test_a_waiter_cancelled_at_the_head_lets_the_next_one_in() -> None:
    async def scenario() -> None:
        gate, release = BackgroundGate(2), asyncio.Event()
        holder = asyncio.create_task(_hold(gate, 100, [], release))
        await asyncio.sleep(0.01)
        wide = asyncio.create_task(_seqs(gate, 2, release))
        narrow_in = asyncio.Event()
        narrow = asyncio.create_task(_seqs(gate, 1, release, narrow_in))
        await asyncio.sleep(0.01)
        assert gate.waiting == 2 and not narrow_in.is_set()
        wide.cancel()  # Its client went away: the one behind it fits now.
        await asyncio.gather(wide, return_exceptions=True)
        async with asyncio.timeout(1):
            await narrow_in.wait()
        assert gate.waiting == 0 and gate.running == 2
        release.set()
        await asyncio.gather(holder, narrow)
        assert gate.running == 0

    asyncio.run(scenario())


async def _seqs(
    gate: BackgroundGate, seqs: int, release: asyncio.Event, entered: asyncio.Event | None = None
) -> None:
    async with gate.slot(100, seqs):
        if entered is not None:
            entered.set()
        await release.wait()
