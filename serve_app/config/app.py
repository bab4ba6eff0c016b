"""Application config: one pydantic model, every field typed, documented and bounded.

``build_app(args)`` validates the ``args`` block of a Serve config file against ``AppConfig``;
errors name the field and the fix. This package is the ground floor: it imports nothing else of
serve_app, so every layer can read the config without pulling in HTTP, Ray or vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from serve_app.config.base import StrictModel
from serve_app.config.batch import BatchApiConfig
from serve_app.config.engine import EngineConfig
from serve_app.config.lora import LoraConfig
from serve_app.config.model import ModelConfig
from serve_app.config.models import ModelBlock
from serve_app.config.replicas import PreprocessorConfig, ReplicaConfig
from serve_app.config.security import SecurityConfig

DRAIN_SLACK_S = 10  # Past request_timeout_s: time for the last chunks and the replica's exit.
# The one-model shorthand: these top-level keys are the single item of `models`.
ONE_MODEL_KEYS = ("model", "engine", "preprocessor", "lora")


class TracingConfig(StrictModel):
    exporter: Literal["otlp", "console", "memory", "none"] | None = Field(
        None,
        description="Span exporter; default: $OTEL_TRACES_EXPORTER or none. Endpoint, protocol "
        "and service name come from the standard OTEL_* variables, forwarded to every replica.",
    )


class AppConfig(StrictModel):
    """Everything `build_app` needs; the `args` block of serve_config*.yaml.

    One model: top-level ``model``, ``engine``, ``preprocessor`` (and ``lora``). Several:
    ``models: [{model, engine, preprocessor, lora}, ...]``. Either way ``config.model`` and
    friends are the first model's, and ``for_model(i)`` is the config one model's replicas get.
    """

    models: list[ModelBlock] = Field(
        default_factory=lambda: [ModelBlock()],
        min_length=1,
        max_length=32,
        description="The models behind this app's router, each with its own engine, "
        "preprocessor and LoRA adapters; clients pick one by `model`. Shorthand for one: "
        "top-level model/engine/preprocessor/lora.",
    )
    router: ReplicaConfig = Field(default_factory=ReplicaConfig)
    tracing: TracingConfig = Field(
        default_factory=TracingConfig, description="OpenTelemetry traces across all hops."
    )
    request_timeout_s: float = Field(
        600, gt=0, description="A request running longer gets 504 and its engine work aborted."
    )
    engine_wait_timeout_s: float = Field(
        30,
        gt=0,
        description="A request no engine replica accepts within this time (none running, or "
        "all full) gets 503 backend_unavailable instead of waiting for request_timeout_s.",
    )
    health_timeout_s: float = Field(
        2,
        gt=0,
        description="Bound on the call /health makes to Serve's controller (never to an "
        "engine) for the number of running engine replicas; past it the last answer stands.",
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="API keys, per-key rate limits, body/header size and request shape limits.",
    )
    sse_keepalive_s: float = Field(
        15,
        ge=0,
        description="While a stream waits (queued, or a long step), send an SSE comment line "
        "this often so proxies and load balancers with idle timeouts keep the connection; "
        "0 disables.",
    )
    fault_injection: bool = Field(
        False,
        description="Tests only: a request with the stop string 'serve_app-fault:<stage>' "
        "(preprocess, engine) raises an unexpected exception there, as a bug would. Never in "
        "production.",
    )
    batch_api: BatchApiConfig = Field(
        default_factory=BatchApiConfig,
        description="The OpenAI Batch API: coordinator placement, storage, quotas, pacing.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_model_shorthand(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(key in data for key in ONE_MODEL_KEYS):
            return data
        given = [key for key in ONE_MODEL_KEYS if key in data]
        if "models" in data:
            raise ValueError(
                f"both `models` and top-level {', '.join(given)}: list every model under "
                "`models` (or use the top-level keys for a single model)"
            )
        rest = {key: value for key, value in data.items() if key not in ONE_MODEL_KEYS}
        return rest | {"models": [{key: data[key] for key in given}]}

    @property
    def model(self) -> ModelConfig:
        return self.models[0].model

    @property
    def engine(self) -> EngineConfig:
        return self.models[0].engine

    @property
    def preprocessor(self) -> PreprocessorConfig:
        return self.models[0].preprocessor

    @property
    def lora(self) -> LoraConfig:
        return self.models[0].lora

    def for_model(self, index: int) -> AppConfig:
        """The config of one model's replicas: that model as the only one."""
        return self.model_copy(update={"models": [self.models[index]]})

    @model_validator(mode="after")
    def _names_are_unique(self) -> AppConfig:
        """Every name a client can put in `model` means one thing; deployment names differ."""
        served = [block.model.public_name for block in self.models]
        adapters = [name for block in self.models for name in block.lora.adapters]
        names = served + adapters
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(
                f"model and adapter names must be unique across models: {twice} appear twice "
                "(set model.served_model_name or rename the adapter)"
            )
        ids = [block.block_id for block in self.models[1:]]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"models: two blocks get the same deployment id ({ids}); set `id` on them"
            )
        return self

    def _drain_parts(self) -> list[tuple[str, ReplicaConfig]]:
        parts: list[tuple[str, ReplicaConfig]] = [("router", self.router)]
        for i, block in enumerate(self.models):
            where = "" if len(self.models) == 1 else f"models[{i}]."
            parts += [
                (f"{where}preprocessor", block.preprocessor),
                (f"{where}engine", block.engine),
            ]
        return parts

    @model_validator(mode="after")
    def _drains_cover_requests(self) -> AppConfig:
        """Every deployment drains at least as long as a request may run (scale-down, upgrades
        and shutdown then never cut a generation short)."""
        for name, part in self._drain_parts():
            grace = part.graceful_shutdown_timeout_s
            if grace is None:
                part.graceful_shutdown_timeout_s = self.request_timeout_s + DRAIN_SLACK_S
            elif grace < self.request_timeout_s:
                raise ValueError(
                    f"{name}.graceful_shutdown_timeout_s {grace:g} is below request_timeout_s "
                    f"{self.request_timeout_s:g}: scale-down and shutdown would cut requests "
                    "short; raise it (or leave it unset) or lower request_timeout_s"
                )
        return self

    def background_slots(self, *, most: bool = False) -> int:
        """Background requests the engines admit (max_num_seqs - interactive_reserved_seqs per
        replica) over the fixed replica count, or over min (``most``: max) replicas."""
        engine = self.engine
        per_replica = max(1, engine.max_num_seqs - engine.interactive_reserved_seqs)
        if engine.num_replicas != "auto":
            return per_replica * engine.num_replicas
        return per_replica * max(1, engine.max_replicas if most else engine.min_replicas)

    def batch_lines_in_flight(self) -> int:
        return self.batch_api.lines_in_flight(self.background_slots())

    @model_validator(mode="after")
    def _batch_lines_fit_the_engines(self) -> AppConfig:
        wanted, most = self.batch_api.max_lines_in_flight, self.background_slots(most=True)
        if wanted is not None and wanted > most:
            raise ValueError(
                f"batch_api.max_lines_in_flight {wanted} exceeds the {most} background slots "
                "of the engines (max_num_seqs - interactive_reserved_seqs per replica); lower "
                "it so batches never take the slots kept for interactive requests"
            )
        return self
