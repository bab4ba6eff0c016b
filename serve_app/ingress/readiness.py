"""Readiness from cached state: ``/health`` never waits in line behind traffic.

The verdict is whether Serve's controller counts a RUNNING replica of this app's engine
deployment. Serve keeps a replica RUNNING only while its own health checks pass (the engine's
``check_health``: vLLM alive, the watchdog content), so the verdict carries the engine's health;
asking the controller costs no engine call, so a saturated engine stays ready (saturation shows
in the metrics, not as pods leaving the Service). Cached for ``ttl_s``, with one refresh in
flight at a time however often probes come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger("serve_app.ingress")


class Readiness:
    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]],
        *,
        ttl_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._ready = False
        self._checked_at: float | None = None
        self._refresh: asyncio.Future[bool] | None = None

    async def ready(self) -> bool:
        if self._checked_at is not None and self._clock() - self._checked_at < self._ttl_s:
            return self._ready
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._run_probe())
        try:
            return await asyncio.wait_for(asyncio.shield(self._refresh), self._timeout_s)
        except TimeoutError:
            return False  # The probe goes on; a later call reads its verdict.

    async def _run_probe(self) -> bool:
        try:
            ready = bool(await self._probe())
        except Exception as exc:
            logger.warning("Readiness probe failed: %r", exc)
            ready = False
        self._ready, self._checked_at = ready, self._clock()
        return ready


async def engine_running(app_name: str, deployment_name: str) -> bool:
    """Whether Serve's controller counts a RUNNING replica of ``deployment_name``."""
    from ray import serve
    from ray.serve._private.common import ReplicaState

    status = await asyncio.to_thread(serve.status)
    app = status.applications.get(app_name)
    deployment = app.deployments.get(deployment_name) if app is not None else None
    return deployment is not None and (deployment.replica_states.get(ReplicaState.RUNNING) or 0) > 0
