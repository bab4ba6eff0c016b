"""Engine autoscaling settings and the Serve ``autoscaling_config`` they become.

The policy itself (``EngineQueuePolicy``) lives with the engine (``serve_app.engine.autoscaling``);
this module only names it, so the config stays importable without the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from serve_app.config.base import StrictModel

QUEUE_METRIC = "engine_queue"
POLICY_PATH = "serve_app.engine.autoscaling:EngineQueuePolicy"


class EngineAutoscalingConfig(StrictModel):
    """Engine autoscaling, used when ``engine.num_replicas`` is ``"auto"``."""

    policy: Literal["queue_depth", "ongoing_requests"] = Field(
        "queue_depth",
        description="'queue_depth': vLLM running + waiting requests per replica; "
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
