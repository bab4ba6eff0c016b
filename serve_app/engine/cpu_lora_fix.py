"""vLLM 0.32 on CPU: base-model rows batched with adapter rows get the adapter. This fixes it.

vLLM marks "no LoRA" tokens with index -1. Its GPU (Triton) kernels skip them; the PyTorch ops
used on CPU (``vllm/lora/ops/torch_ops/lora_ops.py``) index ``lora_weights[indices]``, so -1
picks the LAST adapter slot: a base request sharing an engine step with an adapter request
silently gets that adapter's delta (seen: the base model answering an adapter's marker word).
Upstream: vllm-project/vllm PRs #48421 and #49656 (open as of 0.32).

The fix wraps ``bgmv_shrink`` / ``bgmv_expand`` / ``bgmv_expand_slice`` so rows whose index is
-1 are left untouched, as the Triton kernels do (the ``sgmv_*`` prefill ops call these
module-level names, so they are covered). It must run in vLLM's *worker* process: the engine
arguments name ``CPULoRAFix`` as ``worker_extension_cls`` (``engine/vllm_args.py`` does, for CPU
engines with LoRA), so every worker imports this module, which applies the patch, before the
model is built. ``apply()`` is idempotent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_APPLIED = False


def _skip_no_lora_rows(op: Callable[..., Any]) -> Callable[..., Any]:
    """op(inputs, weights, output, indices, *rest): leave rows with index < 0 untouched."""

    @functools.wraps(op)
    def wrapper(
        inputs: Any, lora_weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any
    ) -> Any:
        invalid = indices < 0
        if not bool(invalid.any()):
            return op(inputs, lora_weights, output, indices, *args, **kwargs)
        if bool(invalid.all()):
            return None  # No row has an adapter: nothing to add.
        if output.shape[0] != indices.shape[0]:
            # Another layout: append an all-zero adapter slot, which -1 then selects.
            import torch

            zero_slot = torch.zeros_like(lora_weights[:1])
            weights = torch.cat([lora_weights, zero_slot])
            return op(inputs, weights, output, indices, *args, **kwargs)
        saved = output[invalid].clone()
        op(inputs, lora_weights, output, indices.clamp(min=0), *args, **kwargs)
        output[invalid] = saved
        return None

    wrapper.__cpu_lora_fix__ = True  # type: ignore[attr-defined]
    return wrapper


def apply() -> bool:
    """Patch vLLM's torch LoRA ops in this process; True once applied."""
    global _APPLIED
    if _APPLIED:
        return True
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        original = getattr(lora_ops, name)
        if getattr(original, "__cpu_lora_fix__", False):
            continue
        patched = _skip_no_lora_rows(original)
        for module in (lora_ops, torch_ops, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, patched)
    _APPLIED = True
    return True


class CPULoRAFix:
    """Empty worker extension: naming it in ``worker_extension_cls`` imports this module (and so
    applies the patch) in every vLLM worker process."""


apply()
