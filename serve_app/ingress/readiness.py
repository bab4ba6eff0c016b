"""Readiness from cached state: does this app have a RUNNING engine replica?

Serve's controller health-checks every engine replica (``check_health``: the engine watchdog's
last verdict — engine core alive and making progress) and keeps RUNNING only those that pass.
``/health`` reads that count from the controller, at most once per ``REFRESH_S`` for all the
probes of this router replica, and never calls an engine: a probe neither waits behind traffic
nor fails because the engine is busy (saturation shows in the metrics, not in readiness).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("serve_app.ingress.readiness")
REFRESH_S = 2.0


class Readiness:
    """The last known count of running engine replicas, refreshed on demand (single flight)."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[int]],
        *,
        timeout_s: float,
        refresh_s: float = REFRESH_S,
        on_update: Callable[[int], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe, self._timeout_s, self._refresh_s = probe, timeout_s, refresh_s
        self._on_update, self._clock = on_update, clock
        self.engines: int | None = None  # None until the controller first answered.
        self.checked_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None

    async def ready(self) -> bool:
        if self._clock() - self.checked_at >= self._refresh_s:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.create_task(self._update())
            # Bounded: a slow controller leaves the last verdict in place.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._refresh), self._timeout_s)
        return bool(self.engines)

    async def _update(self) -> None:
        try:
            self.engines = await asyncio.wait_for(self._probe(), self._timeout_s)
        except Exception as exc:  # The data plane serves without the controller: keep the last.
            logger.warning("Readiness: controller did not answer (%r); keeping the last count", exc)
        else:
            if self._on_update is not None:
                self._on_update(self.engines)
        self.checked_at = self._clock()


_controller: Any = None


async def running_replicas(app_name: str, deployment: str) -> int:
    """RUNNING replicas of ``deployment`` per Serve's controller (a control-plane call)."""
    global _controller
    import ray
    from ray.serve._private.common import ReplicaState
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    if _controller is None:
        _controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    try:
        details = await _controller.get_deployment_details.remote(app_name, deployment)
    except Exception:
        _controller = None  # Look it up again next time (e.g. a restarted controller).
        raise
    return sum(1 for replica in details.replicas if replica.state == ReplicaState.RUNNING)


async def fewest_running(app_name: str, deployments: list[str]) -> int:
    """The fewest RUNNING replicas of any of ``deployments`` (an app serving several models is
    ready when every model has an engine)."""
    counts = await asyncio.gather(*(running_replicas(app_name, d) for d in deployments))
    return min(counts)
