"""The simulator's baselines: Serve's real default router and consistent hashing.

Each returns ``choose(request index, block hashes) -> replica index``.
"""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_right
from collections.abc import Callable, Coroutine
from typing import Any

from serve_app.engine.routing.policy import stable_key

Chooser = Callable[[int, list[int]], int]


def _run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("Serve's router waited: its queue-length cache was not warm")


def serve_default(
    names: list[str], queues: dict[str, int]
) -> tuple[Chooser, Callable[[str], None]]:
    """Serve's own PowerOfTwoChoicesRequestRouter with an exact queue-length cache."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    deployment = DeploymentID(name="Engine", app_name="sim")

    class SimReplica:  # What Serve's router reads from a RunningReplica.
        def __init__(self, name: str) -> None:
            self.replica_id = ReplicaID(unique_id=name, deployment_id=deployment)
            self.max_ongoing_requests = 10**9  # Never full: no probing.
            self.node_id, self.availability_zone = "n", None
            self.multiplexed_model_ids: set[str] = set()

        async def get_queue_len(self, *, deadline_s: float) -> int:
            return queues[self.replica_id.unique_id]

    router = PowerOfTwoChoicesRequestRouter(
        deployment_id=deployment,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router._replica_queue_len_cache = ReplicaQueueLengthCache(staleness_timeout_s=math.inf)
    ids = {n: ReplicaID(n, deployment) for n in names}

    async def start() -> None:
        router.update_replicas([SimReplica(n) for n in names])  # type: ignore[misc]

    asyncio.run(start())
    for rid in ids.values():
        router._replica_queue_len_cache.update(rid, 0)
    index = {n: i for i, n in enumerate(names)}

    def choose(i: int, hashes: list[int]) -> int:
        ranks = _run_sync(router.choose_replicas(router._replicas_list, None))
        chosen = _run_sync(router._select_from_candidate_replicas(ranks[0], 0))
        return index[chosen.replica_id.unique_id]

    def on_queue_change(name: str) -> None:
        router._replica_queue_len_cache.update(ids[name], queues[name])

    return choose, on_queue_change


def consistent_hash(names: list[str], vnodes: int = 100) -> Chooser:
    ring = sorted((stable_key(f"{n}#{v}"), i) for i, n in enumerate(names) for v in range(vnodes))
    points = [point for point, _ in ring]

    def choose(i: int, hashes: list[int]) -> int:
        return ring[bisect_right(points, hashes[0]) % len(ring)][1]

    return choose
