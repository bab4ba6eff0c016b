"""A call whose engine replica is lost (dead, or hung: its transport never fails) is told so
and resubmitted before its first item; a replica that left the set but still answers (a drain)
keeps its calls. Driven without a cluster: the registry, the handle bound and the Serve
request router adapter with fake replicas."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from serve_app.engine.routing import departures as departures_module
from serve_app.engine.routing import serve_router
from serve_app.engine.routing.departures import ENGINE_DEPARTURES, EngineDepartures
from serve_app.errors import APIError
from serve_app.ingress.handles import bounded_stream, resubmitted_once
from tests.unit.test_routing_serve_adapter import (
    FakeReplica,
    engine_request,
    pending,
    started_router,
)


def test_a_watched_call_is_told_when_its_replica_is_lost() -> None:
    async def scenario() -> None:
        registry = EngineDepartures()
        with registry.watch("a") as lost_a, registry.watch("b") as lost_b:
            assert not registry.watching("e1")
            registry.routed("a", "e1")
            registry.routed("b", "e2")
            assert registry.watching("e1") and not registry.watching("e3")
            registry.lost("e1")
            await asyncio.sleep(0)
            assert lost_a.done() and not lost_b.done()
        assert not registry.watching("e2")  # Unwatched when the call ends.

    asyncio.run(scenario())


def test_a_call_routed_to_a_replica_already_lost_is_told_at_once() -> None:
    async def scenario() -> None:
        registry = EngineDepartures()
        registry.lost("e1")
        with registry.watch("a") as lost:
            registry.routed("a", "e1")
            await asyncio.sleep(0)
            assert lost.done()

    asyncio.run(scenario())


def test_the_loss_may_be_told_from_another_thread() -> None:
    """Serve may run the request router on a loop of its own thread."""

    async def scenario() -> None:
        registry = EngineDepartures()
        with registry.watch("a") as lost:
            registry.routed("a", "e1")
            threading.Thread(target=registry.lost, args=("e1",)).start()
            await asyncio.wait_for(lost, 5)

    asyncio.run(scenario())


def test_lost_replicas_are_remembered_within_a_bound() -> None:
    registry = EngineDepartures()
    for i in range(departures_module.LOST_REMEMBERED + 50):
        registry.lost(f"e{i}")
    assert len(registry._lost) == departures_module.LOST_REMEMBERED
    assert "e0" not in registry._lost


class Silent:
    """A handle response whose replica never answers (a hung replica keeps its connection)."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self) -> Silent:
        return self

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class Answers:
    def __init__(self, items: list[str]) -> None:
        self._items = iter(items)

    def __aiter__(self) -> Answers:
        return self

    async def __anext__(self) -> str:
        await asyncio.sleep(0)
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


def test_a_silent_call_on_a_lost_replica_is_resubmitted_long_before_its_timeout() -> None:
    registry = EngineDepartures()
    silent = Silent()

    def attempt(again: bool) -> AsyncIterator[Any]:
        response: Any = Answers(["a", "b"]) if again else silent
        return bounded_stream(
            lambda: response, assign_timeout_s=5, timeout_s=600, watch=registry.watch("r")
        )

    async def scenario() -> list[Any]:
        async def lose_it() -> None:
            await asyncio.sleep(0.05)
            registry.routed("r", "e1")  # As the request router records it once accepted.
            registry.lost("e1")

        loser = asyncio.create_task(lose_it())
        items = [i async for i in resubmitted_once(attempt, backoff_s=0)]
        await loser
        return items

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == ["a", "b"]
    assert silent.cancelled  # The first call is cancelled, not left running.


def test_after_the_first_item_a_lost_replica_is_the_transports_business() -> None:
    """Part of the answer is out: the watch no longer applies (and costs nothing per item)."""
    registry = EngineDepartures()

    async def scenario() -> list[Any]:
        items = []
        stream = bounded_stream(
            lambda: Answers(["a", "b"]), assign_timeout_s=5, timeout_s=60, watch=registry.watch("r")
        )
        async for item in stream:
            registry.routed("r", "e1")
            registry.lost("e1")
            items.append(item)
        return items

    assert asyncio.run(scenario()) == ["a", "b"]


def test_a_lost_replica_ends_a_watched_call_with_engine_unavailable() -> None:
    registry = EngineDepartures()

    async def scenario() -> None:
        stream = bounded_stream(
            lambda: Silent(), assign_timeout_s=5, timeout_s=600, watch=registry.watch("r")
        )
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, registry.routed, "r", "e1")  # Once the call is under way.
        loop.call_later(0.05, registry.lost, "e1")
        await anext(stream)

    with pytest.raises(APIError) as error:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    assert error.value.info.code == "engine_unavailable" and error.value.info.status == 503


class Hung(FakeReplica):
    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.Event().wait()
        return 0


def test_the_router_probes_a_departed_replica_and_loses_it_only_if_it_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serve_router, "DEPARTED_PROBE_S", 0.05)
    monkeypatch.setattr(serve_router, "DEPARTED_PROBE_EVERY_S", 0.05)

    async def scenario() -> tuple[bool, bool]:
        rr, replicas = await started_router()
        hung = Hung("e3", 64 * 1000)
        rr.update_replicas([*replicas, hung])  # type: ignore[list-item]
        await asyncio.sleep(0.01)
        draining = replace(engine_request(), request_id="drains")
        hung_request = replace(engine_request(), request_id="hangs")
        with (
            ENGINE_DEPARTURES.watch("drains") as drain_lost,
            ENGINE_DEPARTURES.watch("hangs") as hang_lost,
        ):
            rr.on_request_routed(pending(draining), replicas[0].replica_id, None)
            rr.on_request_routed(pending(hung_request), hung.replica_id, None)
            rr.update_replicas(replicas[1:])  # type: ignore[arg-type]
            await asyncio.sleep(0.5)
            return drain_lost.done(), hang_lost.done()

    assert asyncio.run(scenario()) == (False, True)


def test_a_replica_serve_finds_dead_loses_its_calls_at_once() -> None:
    async def scenario() -> bool:
        rr, replicas = await started_router()
        request = replace(engine_request(), request_id="dies")
        with ENGINE_DEPARTURES.watch("dies") as lost:
            rr.on_request_routed(pending(request), replicas[0].replica_id, None)
            rr.on_replica_actor_died(replicas[0].replica_id)
            await asyncio.sleep(0)
            return lost.done()

    assert asyncio.run(scenario())
