"""``engine.vllm_args``: vLLM engine arguments passed through, minus the ones the app derives.

Names are checked against vLLM's own ``EngineArgs`` when the app is built
(``serve_app.engine.vllm_args.check_vllm_arg_names``: it needs vLLM, which this ground floor
never imports). Here, without vLLM: dashes become underscores (vLLM's CLI spelling works too)
and an argument the app derives from its own config is refused with the field to set instead,
never silently overridden.
"""

from __future__ import annotations

from typing import Any

# vLLM argument -> where the app config sets it.
DERIVED: dict[str, str] = {
    "model": "model.name",
    "served_model_name": "model.served_model_name",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "trust_remote_code": "model.trust_remote_code",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "block_size": "engine.block_size",
    "enable_prefix_caching": "engine.enable_prefix_caching",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "structured_outputs_config": "engine.compact_json and engine.structured_output_backend",
    "distributed_executor_backend": "engine.device and the parallel sizes (derived)",
    "enable_lora": "lora.enabled (or lora.adapters)",
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora.max_cpu_loras",
    "generation_config": "model.generation_defaults (the preprocessor applies the defaults)",
}
# vLLM arguments the app fixes, and why.
FIXED: dict[str, str] = {
    "scheduling_policy": "the app needs vLLM's priority scheduling (interactive requests "
    "overtake the Batch API's)",
    "disable_log_stats": "the hung-engine watchdog hears of every engine step through vLLM's stats",
}
# Derived only when the model block sets what they come from (else they pass through).
DERIVED_IF = {
    "hf_overrides": "model.rope_scaling",
}


def normalize_vllm_args(args: dict[str, Any]) -> dict[str, Any]:
    """Dashes to underscores; a derived argument is a ValueError naming the field to use."""
    out: dict[str, Any] = {}
    for raw, value in args.items():
        key = raw.replace("-", "_")
        if key in DERIVED:
            raise ValueError(f"vllm_args.{raw} is derived by the app; set {DERIVED[key]} instead")
        if key in FIXED:
            raise ValueError(f"vllm_args.{raw} cannot be changed: {FIXED[key]}")
        if key in out:
            raise ValueError(f"vllm_args.{raw} is given twice (dashes and underscores)")
        out[key] = value
    return out
