"""vLLM's engine arguments: derived from the app config plus ``engine.vllm_args``, and read
back from a running engine. The names derived here are listed in ``serve_app.config.vllm_args``.
"""

from __future__ import annotations

import copy
from typing import Any

from serve_app.config import AppConfig
from serve_app.models.cpu_features import native_bf16

# EngineArgs names whose resolved value vLLM keeps under another name.
_RENAMED = {"kv_cache_dtype": ("cache_config", "cache_dtype")}
# Where a VllmConfig keeps what EngineArgs resolved to, searched in this order.
_SECTIONS = ("model_config", "cache_config", "scheduler_config", "parallel_config", "load_config")


def engine_args(config: AppConfig, model_path: str) -> dict[str, Any]:
    """vLLM engine arguments derived from the app config, then ``engine.vllm_args`` (which
    cannot collide: the config rejects the names derived here)."""
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
    if model.uses_lora:
        args["enable_lora"] = True
    if model.rope_scaling:
        args["hf_overrides"] = {"rope_scaling": model.rope_scaling}
    derived = {key: value for key, value in args.items() if value is not None}
    # A copy: vLLM fills in nested dicts it is given (e.g. speculative_config) in place.
    return derived | copy.deepcopy(engine.vllm_args)


def resolved_dtype(dtype: str, device: str, cpu_flags: set[str] | None = None) -> str:
    """``auto`` on a CPU without native bf16 is float32: there vLLM's auto (the checkpoint's
    bf16) runs emulated matmuls about 6x slower than fp32. An explicit dtype always stands."""
    if dtype != "auto" or device != "cpu":
        return dtype
    return "float32" if native_bf16(cpu_flags) is False else dtype


def vllm_engine_args(args: dict[str, Any], cls: type[Any], **extra: Any) -> Any:
    """``cls`` (vLLM's ``EngineArgs`` or ``AsyncEngineArgs``) from ``engine_args`` output."""
    from vllm.config import StructuredOutputsConfig

    kwargs = dict(args) | extra
    structured = StructuredOutputsConfig(**kwargs.pop("structured_outputs_config"))
    return cls(**kwargs, structured_outputs_config=structured)


def resolved_values(vllm_config: Any, names: list[str]) -> dict[str, Any]:
    """What a running engine resolved for these ``EngineArgs`` names, read from its
    ``VllmConfig``; a name found nowhere is left out. Values beyond plain ones come as text."""
    out: dict[str, Any] = {}
    for name in names:
        section, attribute = _RENAMED.get(name, ("", name))
        holders = [getattr(vllm_config, s, None) for s in ([section] if section else _SECTIONS)]
        for holder in [*holders, vllm_config]:
            if holder is not None and hasattr(holder, attribute):
                value = getattr(holder, attribute)
                plain = value is None or isinstance(value, str | int | float | bool)
                out[name] = value if plain else str(value)
                break
    return out
