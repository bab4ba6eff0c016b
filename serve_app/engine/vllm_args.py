"""vLLM's engine arguments, derived from the app config (one place for serving and offline)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from serve_app.config import AppConfig
from serve_app.config.models import CPU_LORA_EXTENSION
from serve_app.models.cpu_features import native_bf16


def engine_args(config: AppConfig, model_path: str) -> dict[str, Any]:
    """vLLM engine arguments derived from the app config (logged at start for comparisons)."""
    model, engine = config.model, config.engine
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": model.public_name,
        "dtype": resolved_dtype(model.dtype, engine.resolved_device()),
        "max_model_len": model.max_model_len,
        "trust_remote_code": model.trust_remote_code,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "pipeline_parallel_size": engine.pipeline_parallel_size,
        "block_size": engine.block_size,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "enforce_eager": engine.enforce_eager,
        "seed": engine.seed,
        # Priority scheduling lets interactive requests overtake background ones.
        "scheduling_policy": "priority",
        # The preprocessor's defaults are the only defaults (documented precedence).
        "generation_config": "vllm",
        # Small models can loop on whitespace inside JSON until max_tokens; compact JSON
        # leaves them no whitespace to loop on.
        "structured_outputs_config": {
            "backend": engine.structured_output_backend,
            "disable_any_whitespace": engine.compact_json,
        },
    }
    if engine.resolved_device() == "gpu":
        args["gpu_memory_utilization"] = engine.gpu_memory_utilization
        if engine.world_size > 1:
            args["distributed_executor_backend"] = "ray"
    elif engine.world_size > 1:
        # vLLM's CPU build refuses the Ray executor (CpuPlatform.ray_device_key is "": "current
        # platform cpu does not support ray"); its multiprocessing executor runs the ranks as
        # local processes inside the replica's STRICT_PACK placement group.
        args["distributed_executor_backend"] = "mp"
    if model.rope_scaling:
        args["hf_overrides"] = {"rope_scaling": model.rope_scaling}
    args |= lora_args(config)
    args = {key: value for key, value in args.items() if value is not None}
    # Checked against the derived names when the config was validated: none overlaps.
    return args | engine.vllm_args


def resolved_dtype(dtype: str, device: str, cpu_flags: set[str] | None = None) -> str:
    """``auto`` on a CPU without native bf16 is float32: there vLLM's auto (the checkpoint's
    bf16) runs emulated matmuls about 6x slower than fp32."""
    if dtype != "auto" or device != "cpu":
        return dtype
    return "float32" if native_bf16(cpu_flags) is False else dtype


def lora_args(config: AppConfig) -> dict[str, Any]:
    lora = config.lora
    if not lora.active:
        return {}
    args: dict[str, Any] = {
        "enable_lora": True,
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": lora.max_cpu_loras,
    }
    if config.engine.resolved_device() == "cpu":
        # vLLM's CPU LoRA ops apply the last adapter slot to base-model rows batched with
        # adapter rows; the extension, imported in every worker, patches them (see the module).
        args["worker_extension_cls"] = CPU_LORA_EXTENSION
    return args


def vllm_arg_names() -> list[str]:
    """Every keyword vLLM's AsyncEngineArgs takes (its private ones excluded)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = dataclasses.fields(AsyncEngineArgs)
    return sorted(f.name for f in fields if f.init and not f.name.startswith("_"))


def check_vllm_arg_names(vllm_args: dict[str, Any], where: str = "engine.vllm_args") -> None:
    """A ValueError naming the closest valid argument for a name vLLM does not know (vLLM's
    own Python API only says "unexpected keyword argument", after the replica started)."""
    names = vllm_arg_names()
    for key in vllm_args:
        if key in names:
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else " (see vLLM's engine arguments)"
        raise ValueError(f"{where}: {key!r} is not a vLLM engine argument{hint}")


def vllm_engine_args(args: dict[str, Any], cls: type[Any], **extra: Any) -> Any:
    """``cls`` (vLLM's ``EngineArgs`` or ``AsyncEngineArgs``) from ``engine_args`` output."""
    from vllm.config import StructuredOutputsConfig

    kwargs = dict(args) | extra
    structured = StructuredOutputsConfig(**kwargs.pop("structured_outputs_config"))
    return cls(**kwargs, structured_outputs_config=structured)
