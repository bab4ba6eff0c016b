"""A vLLM plugin (``vllm.general_plugins``, run in every vLLM process) mending LoRA on CPUs.

vLLM's PyTorch LoRA ops, which its CPU platform runs, gather ``weights[lora_index]`` for every
token, and a base-model token's index is -1: Python indexing makes that the *last* adapter slot,
so a base request batched next to adapter requests silently gets an adapter applied (vLLM pull
requests 48421 and 49656, open). The GPU kernels skip index -1. This plugin wraps the three ops
so tokens marked -1 keep the output they had, as the GPU kernels leave it, and only where the
installed ops show the bug: a vLLM with the fix is left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("serve_app.engine")

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_PATCHED = "_serve_app_skips_no_lora"


def register() -> None:
    """The plugin's entry point; cheap, and safe to call in any process any number of times."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.lora.ops import torch_ops
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # Another vLLM layout: nothing of ours to mend.
        return
    if getattr(lora_ops.bgmv_shrink, _PATCHED, False) or not applies_base_to_adapter(
        lora_ops.bgmv_shrink
    ):
        return
    for name in _OPS:
        fixed = skipping_no_lora(getattr(lora_ops, name))
        # The sgmv (prefill) ops call these through lora_ops' globals; the wrapper imported them.
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, fixed)
    logger.info("LoRA on CPU: base-model tokens in mixed batches skip the adapters (vLLM#48421)")


def applies_base_to_adapter(bgmv_shrink: Callable[..., Any]) -> bool:
    """True when ``bgmv_shrink`` applies an adapter to a token marked -1 (no LoRA)."""
    import torch

    weights = torch.ones(1, 1, 2, 2)  # One adapter slot: (slots, 1, out, in).
    output = torch.zeros(1, 2)
    bgmv_shrink(torch.ones(1, 2), weights, output, torch.tensor([-1]), 1.0)
    return bool(output.abs().sum() > 0)


def skipping_no_lora(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op(inputs, weights, output, indices, ...)`` leaving rows whose index is -1 as they were."""
    import torch

    @functools.wraps(op)
    def skipping(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output: torch.Tensor,
        indices: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        base_rows = indices < 0
        if indices.shape[0] != output.shape[0] or not bool(base_rows.any()):
            op(inputs, weights, output, indices, *args, **kwargs)
            return
        kept = output[base_rows].clone()
        op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[base_rows] = kept

    setattr(skipping, _PATCHED, True)
    return skipping
