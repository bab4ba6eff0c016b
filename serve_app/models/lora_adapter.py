"""Deterministic LoRA adapters for a local checkpoint, in PEFT's on-disk format.

No hub is reachable here and training one costs minutes, so tests and benchmarks use adapters of
seeded random weights: different seeds give adapters whose greedy output a test can tell apart
from the base model's and from each other's: ``python -m serve_app.models lora MODEL DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Attention projections the adapter changes, and how each one's shape follows from the config.
_TARGETS = ("v_proj", "o_proj")


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targeted projection of a Llama/Qwen2-style checkpoint."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {"v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}


def build_lora_adapter(
    base: str | Path, out: str | Path, *, seed: int, rank: int = 8, strength: float = 1.0
) -> Path:
    """Write an adapter for the checkpoint directory ``base`` into ``out`` (created) and
    return ``out``. ``strength`` scales the update; 0 gives an adapter that changes nothing."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads(Path(base, "config.json").read_text())
    shapes = _shapes(config)
    generator = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in _TARGETS:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = generator.standard_normal((rank, fan_in)) / np.sqrt(fan_in)
            b = generator.standard_normal((fan_out, rank)) * (strength / np.sqrt(rank))
            tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank,  # Scaling alpha / r = 1: strength alone sets the effect.
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(_TARGETS),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
