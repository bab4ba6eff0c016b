"""vLLM's runtime LoRA bodies: POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from pydantic import Field

from serve_app.openai.protocol.common import OpenAIModel


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field("", max_length=1024)
    lora_path: str = Field("", max_length=4096)
    load_inplace: bool = False
    # Ours: the served model the adapter runs on, when several models allow runtime loading.
    base_model_name: str | None = Field(None, max_length=1024)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field("", max_length=1024)
    lora_int_id: int | None = None  # Accepted for vLLM clients; names identify adapters here.
