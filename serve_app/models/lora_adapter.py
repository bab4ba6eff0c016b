"""Deterministic LoRA adapters for a local checkpoint, in PEFT's on-disk format.

No hub is reachable here and training one costs minutes, so tests and benchmarks use adapters of
seeded random weights: different seeds give adapters whose greedy output a test can tell apart
from the base model's and from each other's: ``python -m serve_app.models lora MODEL DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Projections the adapter changes: two attention ones by default; every linear layer (as most
# fine-tunes do, and what a LoRA cost benchmark should pay for) with ALL_TARGETS.
_TARGETS = ("v_proj", "o_proj")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = {"gate_proj", "up_proj", "down_proj"}


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a Llama/Qwen2-style checkpoint."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    if "intermediate_size" in config:
        mlp = int(config["intermediate_size"])
        shapes |= {"gate_proj": (hidden, mlp), "up_proj": (hidden, mlp), "down_proj": (mlp, hidden)}
    return shapes


def build_lora_adapter(
    base: str | Path,
    out: str | Path,
    *,
    seed: int,
    rank: int = 8,
    strength: float = 1.0,
    targets: tuple[str, ...] = _TARGETS,
) -> Path:
    """Write an adapter for the checkpoint directory ``base`` into ``out`` (created) and
    return ``out``. ``strength`` scales the update; 0 gives an adapter that changes nothing.
    ``targets``: the projections it changes (see ALL_TARGETS)."""
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads(Path(base, "config.json").read_text())
    shapes = _shapes(config)
    generator = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in targets:
            fan_in, fan_out = shapes[target]
            block = "mlp" if target in _MLP else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
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
        "target_modules": list(targets),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
