"""Ray Serve replica settings shared by every deployment, and the preprocessor's window."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from serve_app.config.base import StrictModel


class ReplicaConfig(StrictModel):
    """Ray Serve replica settings shared by every deployment."""

    num_replicas: int | Literal["auto"] = Field(1, description="Fixed count or 'auto'.")
    min_replicas: int = Field(1, ge=0, description="Autoscaling lower bound.")
    max_replicas: int = Field(1, ge=1, description="Autoscaling upper bound.")
    target_ongoing_requests: float = Field(
        16, gt=0, description="Autoscaling target of in-flight requests per replica."
    )
    max_ongoing_requests: int = Field(
        256, ge=1, description="In-flight requests one replica accepts before Serve queues."
    )
    max_queued_requests: int = Field(
        -1,
        ge=-1,
        description="Requests queued for this deployment beyond max_ongoing_requests before "
        "callers get 503 + Retry-After (-1: unbounded).",
    )
    backpressure_status: Literal[503, 429] = Field(
        503, description="HTTP status of requests rejected because max_queued_requests is full."
    )
    retry_after_s: float = Field(
        1, ge=0, description="Retry-After (seconds) sent with backpressure rejections."
    )
    graceful_shutdown_timeout_s: float = Field(
        30,
        ge=0,
        description="On shutdown, scale-down or upgrade, in-flight requests and streams get "
        "this long to finish. Set it to request_timeout_s + 10 for engine and router to let "
        "every request run to its own deadline (serve_config.yaml does).",
    )
    num_cpus: float = Field(
        0.1, ge=0, description="CPUs reserved per replica; keep it fractional on small machines."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {gpu_node: 1}, to pin to nodes.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> ReplicaConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}"
            )
        return self

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "backpressure_config": {
                "status_code": self.backpressure_status,
                "retry_after_s": self.retry_after_s,
            },
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "ray_actor_options": {"num_cpus": self.num_cpus},
        }
        if self.resources:
            options["ray_actor_options"]["resources"] = dict(self.resources)
        if self.num_replicas == "auto":
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            options["num_replicas"] = self.num_replicas
        return options


class PreprocessorConfig(ReplicaConfig):
    """The preprocessor's replicas and its aggregation window (Serve's ``@serve.batch``)."""

    aggregation_window_s: float = Field(
        0.01,
        ge=0,
        le=1,
        validation_alias=AliasChoices("aggregation_window_s", "batch_wait_timeout_s"),
        description="How long the preprocessor waits for more requests to tokenize together, "
        "in seconds (0 disables). Old name, still accepted: batch_wait_timeout_s.",
    )
    aggregation_max_requests: int = Field(
        32,
        ge=1,
        le=1024,
        validation_alias=AliasChoices("aggregation_max_requests", "max_batch_size"),
        description="Most requests tokenized together in one window. Old name, still "
        "accepted: max_batch_size.",
    )
    chat_template_timeout_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Longest one request's chat template may take to render, in seconds; "
        "slower is a 400 (code chat_template_limit) for that request only. Renders run inside "
        "the aggregation window, so this also bounds how long one request can hold it up.",
    )
