"""Engine autoscaling on the engine's own queue depth (vLLM running + waiting requests).

Each engine replica reports ``engine_queue`` through Serve's ``record_autoscaling_stats`` hook;
``EngineQueuePolicy`` (a Serve custom autoscaling policy) sizes the deployment so every replica
holds about ``target_queue_depth`` requests. Serve wraps the policy with the min/max bounds and
the up/down delays of ``autoscaling_config`` (``serve_app.config.autoscaling``).
``desired_replicas`` is the pure decision function (unit-tested without Ray).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from serve_app.config.autoscaling import QUEUE_METRIC


def desired_replicas(
    depths: Mapping[Any, float],
    *,
    target_queue_depth: float,
    current_replicas: int,
    fallback_total: float | None = None,
) -> int:
    """Replicas needed so each holds about ``target_queue_depth`` engine requests.

    ``depths``: the latest (window-averaged) queue depth per reporting replica. Replicas still
    starting do not report yet; with no report at all, ``fallback_total`` (Serve's own count of
    in-flight requests) decides, and with neither the count stays as it is.
    """
    if depths:
        total = float(sum(depths.values()))
    elif fallback_total is not None:
        total = float(fallback_total)
    else:
        return current_replicas
    if total <= 0:
        return 0  # Serve clamps to min_replicas.
    return max(1, math.ceil(total / target_queue_depth))


class EngineQueuePolicy:
    """Serve custom autoscaling policy (``policy_function``; kwargs via ``policy_kwargs``)."""

    def __init__(self, target_queue_depth: float = 32, metric: str = QUEUE_METRIC) -> None:
        self.target_queue_depth = float(target_queue_depth)
        self.metric = metric

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        running = set(ctx.running_replicas or ())
        depths = {
            replica: value
            for replica, value in (metrics.get(self.metric) or {}).items()
            if not running or replica in running
        }
        desired = desired_replicas(
            depths,
            target_queue_depth=self.target_queue_depth,
            current_replicas=ctx.current_num_replicas,
            fallback_total=ctx.total_num_requests,
        )
        return desired, {}
