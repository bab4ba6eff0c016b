"""One served model: its checkpoint, engine, preprocessor and LoRA adapters (a ``models:`` item).

An app serves one or several model blocks behind one router. Each block gets its own
Preprocessor and Engine deployments; its adapters share them. The first block's deployments
keep the plain names (``Preprocessor``, ``Engine``), so a single-model app that gains a second
model keeps its running engines; the others are ``Engine-<id>``.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import StrictModel
from serve_app.config.engine import EngineConfig
from serve_app.config.lora import LoraConfig
from serve_app.config.model import ModelConfig
from serve_app.config.replicas import PreprocessorConfig
from serve_app.config.vllm_args import DERIVED_IF

ID_RE = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,47}")
CPU_LORA_EXTENSION = "serve_app.engine.cpu_lora_fix.CPULoRAFix"


def slug(name: str) -> str:
    """A deployment-name-safe id of a served name ('Qwen/Qwen2.5-7B' -> 'qwen-qwen2.5-7b')."""
    text = re.sub(r"[^a-z0-9_.\-]+", "-", name.lower()).strip("-._")
    return text[:48] or "model"


class ModelBlock(StrictModel):
    """One model behind the app's router, with its own deployments and adapters."""

    id: str | None = Field(
        None,
        description="Suffix of this block's deployment names (Engine-<id>, Preprocessor-<id>); "
        "default: derived from the served model name. Ignored for the first block, whose "
        "deployments are Engine and Preprocessor.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    preprocessor: PreprocessorConfig = Field(default_factory=PreprocessorConfig)
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on this model, from the config and/or loaded at runtime.",
    )

    @property
    def block_id(self) -> str:
        return self.id or slug(self.model.public_name)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str | None) -> str | None:
        if value is not None and not ID_RE.fullmatch(value):
            raise ValueError(f"id {value!r}: 1-48 of [a-z0-9_.-], starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _vllm_args_fit(self) -> ModelBlock:
        args = self.engine.vllm_args
        for key, source in DERIVED_IF.items():
            if key in args and getattr(self.model, source.split(".")[1]) is not None:
                raise ValueError(
                    f"engine.vllm_args.{key} conflicts with {source}, which the app turns into "
                    f"{key}; set one of them"
                )
        needs_fix = self.lora.active and self.engine.resolved_device() == "cpu"
        if needs_fix and "worker_extension_cls" in args:
            raise ValueError(
                "engine.vllm_args.worker_extension_cls: LoRA on CPU needs the app's own "
                f"({CPU_LORA_EXTENSION}); remove it or turn LoRA off"
            )
        return self

    def deployment_names(self, first: bool) -> tuple[str, str]:
        """(preprocessor, engine) deployment names of this block."""
        if first:
            return "Preprocessor", "Engine"
        return f"Preprocessor-{self.block_id}", f"Engine-{self.block_id}"
