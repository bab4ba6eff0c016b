"""``AppConfig``: everything ``build_app`` needs, the ``args`` block of a Serve config file.

``build_app(args)`` validates that block against ``AppConfig``; errors name the field and the fix.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from serve_app.config.base import StrictModel
from serve_app.config.batch_api import BatchApiConfig
from serve_app.config.engine import EngineConfig
from serve_app.config.model import ModelConfig
from serve_app.config.replicas import PreprocessorConfig, ReplicaConfig
from serve_app.config.security import SecurityConfig

# gRPC messages between Serve's processes are bounded by our own limits (request bodies, upload
# parts, file downloads), not by gRPC's 4 MiB default; read by each process at start.
GRPC_MESSAGE_ENV = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


class TracingConfig(StrictModel):
    exporter: Literal["otlp", "console", "memory", "none"] | None = Field(
        None,
        description="Span exporter; default: $OTEL_TRACES_EXPORTER or none. Endpoint, protocol "
        "and service name come from the standard OTEL_* variables, forwarded to every replica.",
    )


class ModelEntry(StrictModel):
    """One model of a multi-model app: its checkpoint and its own engine and preprocessor."""

    model: ModelConfig = Field(description="The checkpoint, its served name and defaults.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="This model's engine deployment: the app-level `engine` block, overridden "
        "key by key by this one.",
    )
    preprocessor: PreprocessorConfig = Field(
        default_factory=PreprocessorConfig,
        description="This model's tokenizer deployment: the app-level `preprocessor` block, "
        "overridden key by key by this one.",
    )


def deployment_suffix(public_name: str) -> str:
    """A served model's part of its deployments' names (Engine-<suffix>): Serve names are
    ids in logs, metrics and the dashboard, so they stay readable."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", public_name).strip("-") or "model"


def _inherited(shared: Any, own: Any) -> Any:
    """An entry's engine/preprocessor block over the app-level one, key by key."""
    if isinstance(shared, BaseModel):
        shared = shared.model_dump(exclude_unset=True)
    if isinstance(own, BaseModel):
        own = own.model_dump(exclude_unset=True)
    if not isinstance(shared, dict) or not isinstance(own, dict):
        return own  # Not a mapping: the entry's own validation names the problem.
    return shared | own


class AppConfig(StrictModel):
    """Everything `build_app` needs; the `args` block of serve_config*.yaml."""

    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The model, when the app serves one."
    )
    models: list[ModelEntry] = Field(
        default_factory=list,
        max_length=16,
        description="Several models behind one router, which dispatches on the request's "
        "`model`: each entry {model, engine, preprocessor} gets its own engine and "
        "preprocessor deployments (Engine-<name>, Preprocessor-<name>). The app-level `engine` "
        "and `preprocessor` blocks are every entry's defaults. Leave `model` unset.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    preprocessor: PreprocessorConfig = Field(default_factory=PreprocessorConfig)
    router: ReplicaConfig = Field(default_factory=ReplicaConfig)
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry traces across all hops."
    )
    batch_api: BatchApiConfig = Field(
        default_factory=BatchApiConfig, description="The Batch API's file uploads."
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
    serve_throughput_mode: bool = Field(
        True,
        description="Ray Serve's throughput mode (RAY_SERVE_THROUGHPUT_OPTIMIZED) in every "
        "replica of the app: calls between deployments go over gRPC instead of Ray tasks and "
        "objects, and user code and handle routing share each replica's event loop instead of "
        "hopping threads (about a third less CPU per streamed token in the router and engine "
        "replicas; `loadtest.cpu_cost`). Direct ingress stays off: it needs Serve's proxy and "
        "controller started in the mode. false: Serve's defaults.",
    )

    @model_validator(mode="before")
    @classmethod
    def _entries_inherit(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("models"):
            return data
        if data.get("model") is not None:
            raise ValueError(
                "set `model` (one model) or `models` (several), not both: move the `model` "
                "block into a `models` entry"
            )
        if not isinstance(data["models"], list):
            return data  # The field's own validation names the problem.
        entries = []
        for entry in data["models"]:
            if isinstance(entry, dict):
                entry = dict(entry)
                for block in ("engine", "preprocessor"):
                    if block in data:
                        entry[block] = _inherited(data[block], entry.get(block) or {})
            entries.append(entry)
        return data | {"models": entries}

    @model_validator(mode="after")
    def _distinct_names(self) -> AppConfig:
        names = [entry.model.public_name for entry in self.models]
        suffixes = [deployment_suffix(name) for name in names]
        for index, suffix in enumerate(suffixes):
            if suffix in suffixes[:index]:
                other = names[suffixes.index(suffix)]
                raise ValueError(
                    f"models[{index}]: {names[index]!r} and {other!r} share the name "
                    f"{suffix!r} (served name, or its deployments' names); set a distinct "
                    "model.served_model_name"
                )
        return self

    def per_model(self) -> list[AppConfig]:
        """One single-model config per served model: the app itself when it serves one. Each
        is what that model's preprocessor and engine deployments run with."""
        if not self.models:
            return [self]
        return [
            self.model_copy(
                update={
                    "model": entry.model,
                    "engine": entry.engine,
                    "preprocessor": entry.preprocessor,
                    "models": [],
                }
            )
            for entry in self.models
        ]

    @property
    def served_names(self) -> list[str]:
        """The names clients put in `model`, in config order."""
        return [config.model.public_name for config in self.per_model()]

    def as_args(self) -> dict[str, Any]:
        """This config as plain data that validates back to it (what replicas are given)."""
        return self.model_dump(mode="json", exclude={"model"} if self.models else None)
