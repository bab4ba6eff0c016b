"""vLLM's ``LoRARequest`` for our ``LoraAdapter``, for the serving engine and offline jobs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from serve_app.errors import APIError
from serve_app.hops import LoraAdapter

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


class LoraRequests:
    """vLLM keys a loaded adapter by an integer id: one per (name, path, revision), for good,
    so a reload in place (a new revision) is loaded afresh and never mixed with the old."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._ids: dict[tuple[str, str, int], int] = {}

    def get(self, adapter: LoraAdapter | None) -> LoRARequest | None:
        if adapter is None:
            return None
        if not self.enabled:
            raise APIError(
                f"model {adapter.name!r} is a LoRA adapter but this engine runs without LoRA",
                status=400,
                param="model",
                code="model_not_found",
            )
        from vllm.lora.request import LoRARequest

        key = (adapter.name, adapter.path, adapter.revision)
        lora_id = self._ids.setdefault(key, len(self._ids) + 1)
        return LoRARequest(adapter.name, lora_id, adapter.path)
