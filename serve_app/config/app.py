"""``AppConfig``: everything ``build_app`` needs, the ``args`` block of a Serve config file.

``build_app(args)`` validates that block against ``AppConfig``; errors name the field and the fix.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from serve_app.config.base import StrictModel
from serve_app.config.engine import EngineConfig
from serve_app.config.model import ModelConfig
from serve_app.config.replicas import PreprocessorConfig, ReplicaConfig
from serve_app.config.security import SecurityConfig


class TracingConfig(StrictModel):
    exporter: Literal["otlp", "console", "memory", "none"] | None = Field(
        None,
        description="Span exporter; default: $OTEL_TRACES_EXPORTER or none. Endpoint, protocol "
        "and service name come from the standard OTEL_* variables, forwarded to every replica.",
    )


class AppConfig(StrictModel):
    """Everything `build_app` needs; the `args` block of serve_config*.yaml."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    preprocessor: PreprocessorConfig = Field(default_factory=PreprocessorConfig)
    router: ReplicaConfig = Field(default_factory=ReplicaConfig)
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry traces across all hops."
    )
    request_timeout_s: float = Field(
        600,
        gt=0,
        description="A request running longer gets 504 and its engine work aborted.",
    )
    engine_wait_timeout_s: float = Field(
        30,
        gt=0,
        description="A request no engine replica accepts within this time (none running, or "
        "all full) gets 503 backend_unavailable instead of waiting for request_timeout_s.",
    )
    sse_keepalive_s: float | None = Field(
        15,
        gt=0,
        description="A stream silent this long (queued, long prefill) gets an SSE comment line, "
        "so load balancers' idle timeouts keep the connection; a stream not started by then "
        "sends its headers, and a later error arrives as its error event. null: off.",
    )
    health_timeout_s: float = Field(
        2,
        gt=0,
        description="/health answers 503 when Serve's controller has not said within this "
        "whether the app runs a healthy engine replica.",
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="API keys, per-key rate limits, body/header size and request shape limits.",
    )
