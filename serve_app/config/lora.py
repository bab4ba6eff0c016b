"""A model block's LoRA settings: adapters from the config, runtime loading, vLLM's slots."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import StrictModel

# What `model: <name>` may name: no whitespace or control characters, bounded.
ADAPTER_NAME_RE = re.compile(r"[\x21-\x7e]{1,128}")
# A Hugging Face hub id: org/name.
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*")
# vLLM's allowed max_lora_rank values (LoRAConfig).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_adapter_source(source: str) -> str:
    """An absolute local directory or a hub id (org/name): replicas run on other nodes, so a
    relative path would be read from wherever a replica happens to start."""
    if Path(source).is_absolute() or HUB_ID_RE.fullmatch(source):
        return source
    raise ValueError(
        f"adapter source {source!r}: give an absolute directory (on every engine node) or a "
        "Hugging Face hub id such as org/name"
    )


class LoraConfig(StrictModel):
    """LoRA adapters served on top of one model (vLLM's multi-LoRA)."""

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter name (what clients put in `model`) -> an absolute directory "
        "holding a PEFT adapter on every engine node, or a Hugging Face hub id (org/name).",
    )
    enabled: bool | None = Field(
        None,
        description="Start the engine with LoRA support; default: on when adapters are listed "
        "or runtime_loading is on. LoRA engines reserve memory for max_loras adapter slots.",
    )
    runtime_loading: bool = Field(
        False,
        description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter for this "
        "model (needs an admin key when API keys are configured: security.admin_keys).",
    )
    max_runtime_adapters: int = Field(
        64, ge=1, le=10_000, description="Most adapters loaded at runtime for this model."
    )
    max_loras: int = Field(
        1, ge=1, le=256, description="Adapters one engine step can mix (vLLM's max_loras)."
    )
    max_lora_rank: int = Field(
        16, description=f"Largest adapter rank accepted (vLLM's max_lora_rank: {LORA_RANKS})."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="Adapters each engine replica keeps loaded (an LRU in CPU memory; vLLM's "
        "max_cpu_loras); default: max_loras. Least recently used ones are dropped and reloaded "
        "from their source on next use.",
    )

    @property
    def active(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        return bool(self.adapters) or self.runtime_loading

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, value: dict[str, str]) -> dict[str, str]:
        for name, source in value.items():
            if not ADAPTER_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"adapter name {name!r}: 1-128 printable characters without spaces"
                )
            check_adapter_source(source)
        return value

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"max_lora_rank {value}: vLLM accepts one of {LORA_RANKS}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> LoraConfig:
        if self.enabled is False and (self.adapters or self.runtime_loading):
            raise ValueError(
                "lora.enabled is false but adapters or runtime_loading are set; remove them "
                "or enable LoRA"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras}: "
                "an adapter must be cached to run; raise it or leave it unset"
            )
        return self
