"""The model block: which checkpoint, its context window, and the server's sampling defaults."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config.base import StrictModel

MAX_LORA_ADAPTERS = 256
# What a client may put in `model` for an adapter (vLLM's names are free text; ours are ids).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


class GenerationDefaults(BaseModel):
    """Server-side defaults, applied when a request leaves a field unset.

    Precedence for every sampling field: the request's value → this server default → OpenAI's
    default (temperature 1, top_p 1, no penalties).
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0, le=2, description="Default temperature.")
    top_p: float | None = Field(None, gt=0, le=1, description="Default nucleus sampling p.")
    top_k: int | None = Field(None, ge=-1, description="Default top-k (-1 or 0: off).")
    repetition_penalty: float | None = Field(None, gt=0, le=2, description="Default penalty.")
    max_tokens: int | None = Field(
        None, ge=1, description="Default completion length cap when a request sets none."
    )


class ModelConfig(StrictModel):
    name: str = Field(
        "smollm2-135m-instruct",
        description="An embedded alias (smollm2-135m-instruct, tiny-qwen2), a local checkpoint "
        "directory, or a Hugging Face hub id such as Qwen/Qwen2.5-7B-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients put in `model`; defaults to `name`."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context window (prompt + completion). Default: the model's."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight dtype; auto: the checkpoint's, float32 on CPUs without bf16."
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="RoPE scaling override, e.g. {rope_type: yarn, factor: 4.0, "
        "original_max_position_embeddings: 32768} to run Qwen2.5 at 128K.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    generation_defaults: GenerationDefaults = Field(
        default_factory=GenerationDefaults,
        description="Server defaults for sampling fields a request leaves unset.",
    )
    chat_template: str | None = Field(
        None,
        max_length=1024 * 1024,
        description="A Jinja chat template replacing the checkpoint's: the template text, or "
        "the path of a file holding it (read when the config is validated, so replicas on "
        "other nodes get the text). Compiled when the app is built. Requests cannot send "
        "templates.",
    )

    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_LORA_ADAPTERS,
        description="LoRA adapters of this model, served by name: {name: local directory "
        "(PEFT format: adapter_config.json + weights) or hub id}. A request with `model: "
        "<name>` runs the adapter; /v1/models lists it with `parent` the model. Set "
        "engine.vllm_args max_loras (adapters one engine step mixes, default 1) and "
        "max_lora_rank (default 16) to fit them.",
    )

    max_runtime_adapters: int = Field(
        0,
        ge=0,
        le=MAX_LORA_ADAPTERS,
        description="Most adapters loaded at runtime (POST /v1/load_lora_adapter, vLLM's API; "
        "security.admin_keys only when keys are set); 0: runtime loading off. They are kept in "
        "Ray's GCS, so every router replica serves them and replacement replicas keep them.",
    )

    @property
    def uses_lora(self) -> bool:
        return bool(self.lora_adapters) or self.max_runtime_adapters > 0

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, source in value.items():
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(
                    f"adapter name {name!r}: use 1-128 letters, digits and . _ - : / "
                    "(it is what clients put in `model`)"
                )
            if not source.strip():
                raise ValueError(f"adapter {name!r}: give a local directory or a hub id")
        return {name: _absolute_if_local(source) for name, source in value.items()}

    @model_validator(mode="after")
    def _adapters_apart_from_model(self) -> ModelConfig:
        if self.public_name in self.lora_adapters:
            raise ValueError(
                f"lora_adapters: {self.public_name!r} is the model's own served name; "
                "name the adapter differently"
            )
        return self

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:
            return value
        path = Path(value).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"{value!r} is neither a Jinja template (no {{{{ or {{%) nor a readable UTF-8 "
                f"file ({exc}); give the template text or its path"
            ) from None
        if "{{" not in text and "{%" not in text:
            raise ValueError(f"{path} holds no Jinja template (no {{{{ or {{%)")
        return text

    @property
    def public_name(self) -> str:
        return self.served_model_name or self.name


def _absolute_if_local(source: str) -> str:
    """A local adapter path made absolute where the config is first validated (build_app's
    process), so engine replicas, whatever their working directory, load the same files."""
    local = Path(source).expanduser()
    if local.exists() or source.startswith((".", "/", "~")):
        return str(local.absolute())
    return source  # A hub id (org/name), fetched by vLLM where a hub is reachable.


def check_adapter(name: str, source: str) -> None:
    """A local adapter is a PEFT directory (adapter_config.json and weights); a hub id is
    fetched by vLLM on first use. Checked where the app or job is built, not per request."""
    local = Path(source)
    if not local.is_absolute():
        return  # A hub id.
    if not (local / "adapter_config.json").is_file():
        what = "has no adapter_config.json" if local.is_dir() else "is not a directory"
        raise ValueError(
            f"model.lora_adapters.{name}: {source} {what}; give a PEFT adapter directory "
            "(adapter_config.json + adapter_model.safetensors) or a hub id (org/name)"
        )
