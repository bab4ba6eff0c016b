"""Engine autoscaling on the engine's own queue depth (vLLM running + waiting requests).

Each engine replica reports ``engine_queue`` through Serve's ``record_autoscaling_stats`` hook;
``EngineQueuePolicy`` (a Serve custom autoscaling policy) sizes the deployment so every replica
holds about ``target_queue_depth`` requests. Serve wraps the policy with the min/max bounds and
the up/down delays of ``autoscaling_config``. ``desired_replicas`` is the pure decision
function (unit-tested without Ray).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

QUEUE_METRIC = "engine_queue"
POLICY_PATH = "serve_app.engine.autoscaling:EngineQueuePolicy"


class EngineAutoscalingConfig(BaseModel):
    """Engine autoscaling, used when ``engine.num_replicas`` is ``"auto"``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    policy: Literal["queue_depth", "ongoing_requests"] = Field(
        "queue_depth",
        description="'queue_depth': vLLM running + waiting requests per replica (this module); "
        "'ongoing_requests': Serve's default policy on in-flight handle requests.",
    )
    target_queue_depth: float = Field(
        32, gt=0, description="Engine requests (running + waiting) one replica should hold."
    )
    upscale_delay_s: float = Field(
        30, ge=0, description="Load must call for more replicas this long before scaling up."
    )
    downscale_delay_s: float = Field(
        300, ge=0, description="Load must call for fewer replicas this long before scaling down."
    )
    look_back_period_s: float = Field(
        10, gt=0, description="Window over which reported queue depths are averaged."
    )
    metrics_interval_s: float = Field(
        2, gt=0, le=60, description="How often each engine replica reports its queue depth."
    )

    @model_validator(mode="after")
    def _check_window(self) -> EngineAutoscalingConfig:
        if self.metrics_interval_s > self.look_back_period_s:
            raise ValueError(
                f"metrics_interval_s {self.metrics_interval_s} exceeds look_back_period_s "
                f"{self.look_back_period_s}: the window would hold no sample"
            )
        return self


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


def autoscaling_config(
    auto: EngineAutoscalingConfig, *, min_replicas: int, max_replicas: int, target_ongoing: float
) -> dict[str, Any]:
    """The engine deployment's ``autoscaling_config``."""
    config: dict[str, Any] = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "target_ongoing_requests": target_ongoing,
        "upscale_delay_s": auto.upscale_delay_s,
        "downscale_delay_s": auto.downscale_delay_s,
        "look_back_period_s": auto.look_back_period_s,
        "metrics_interval_s": auto.metrics_interval_s,
    }
    if auto.policy == "queue_depth":
        config["policy"] = {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {"target_queue_depth": auto.target_queue_depth},
        }
    return config


def replica_env(auto: EngineAutoscalingConfig) -> dict[str, str]:
    """Environment for engine replicas: report queue depth every ``metrics_interval_s``."""
    return {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": f"{auto.metrics_interval_s:g}"}
