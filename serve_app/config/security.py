"""Security settings: where API keys come from, per-key rate limits, request size and shape limits.

Only the settings: keys themselves are never in the config (the Ray dashboard shows it); the
router loads them (``serve_app.ingress.keys``) and enforces the limits.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from serve_app.config.base import StrictModel

NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# apply_chat_template's own parameters and the inputs it renders: never a client's to set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template", "tokenize", "tools", "documents", "messages", "conversation",
        "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
        "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
        "max_length", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
        "cls_token", "mask_token", "additional_special_tokens",
    }
)  # fmt: skip
# A flag a template reads as a plain Jinja variable: an identifier, nothing longer.
TemplateFlag = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]


class KeyRateLimit(StrictModel):
    """Per-minute budgets of one key (sliding 60 s window, shared by all router replicas)."""

    requests_per_minute: int | None = Field(
        None, ge=1, le=10_000_000, description="Requests per minute per key; unset: unlimited."
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=10**12,
        description="Tokens per minute per key, charged up front: every prompt's estimate "
        "(characters / 4, or the token ids) plus n × max_tokens per prompt plus the tool "
        "definitions (JSON characters / 4); unset: unlimited.",
    )


class RequestLimits(StrictModel):
    """Bounds on one request's shape, checked before any preprocessing (400 with `param`)."""

    max_tokens_cap: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Largest max_tokens / max_completion_tokens accepted; unset: the context "
        "window is the only bound (set model.generation_defaults.max_tokens for a default).",
    )
    max_n: int = Field(16, ge=1, le=128, description="Largest `n` (choices per request).")
    max_messages: int = Field(
        1024, ge=1, le=100_000, description="Most chat messages in one request."
    )
    max_tools: int = Field(128, ge=0, le=10_000, description="Most tool definitions per request.")
    max_prompts: int = Field(
        1024,
        ge=1,
        le=100_000,
        description="Most prompts in one completions request (each is its own engine request; "
        "a 2 MiB body could otherwise carry half a million).",
    )
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        le=10**9,
        description="Most prompt characters (all message contents, or all prompts; a token id "
        "counts as one); unset: bounded by max_body_bytes and the context window.",
    )


class SecurityConfig(StrictModel):
    """The `security` block of AppConfig. No keys configured means no authentication."""

    api_keys_env: str = Field(
        "SERVE_APP_API_KEYS",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="Environment variable (on the router replicas) holding a comma-separated "
        "list of `name:key` or bare keys; set it through the application's runtime_env.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="Absolute path of a file with one `name:key` (or bare key) per line; "
        "blank lines and lines starting with # are skipped. Unreadable: the router fails.",
    )
    requests_per_minute: int | None = Field(
        None, ge=1, le=10_000_000, description="Default requests per minute of every key."
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, le=10**12, description="Default tokens per minute of every key."
    )
    key_rate_limits: dict[str, KeyRateLimit] = Field(
        default_factory=dict,
        description="Per-key-name budgets; an entry replaces both defaults for that key.",
    )
    unset_max_tokens_charge: int = Field(
        1024,
        ge=1,
        le=10_000_000,
        description="Completion tokens charged to tokens_per_minute per prompt and choice when "
        "a chat request sets no max_tokens, or a completion sets it to null (an unset one "
        "defaults to 16, as in OpenAI's API).",
    )
    batch_queue_tokens: int | None = Field(
        None,
        ge=1,
        le=10**13,
        description="Most tokens one key may have enqueued in unfinished Batch API batches, "
        "each line charged as tokens_per_minute charges a request (prompt estimate plus n x "
        "max_tokens per prompt); a batch that would pass it is a 429 with the numbers (like "
        "OpenAI's batch queue limit). Unset: unlimited.",
    )
    key_batch_queue_tokens: dict[str, int] = Field(
        default_factory=dict,
        description="batch_queue_tokens per key name, e.g. {nightly: 50000000}.",
    )
    key_priorities: dict[str, int] = Field(
        default_factory=dict,
        description="Lowest vLLM priority each key name's requests run at (lower runs first), "
        "e.g. {ops: -10, nightly: 100}. A client's lower value is raised to its key's floor; "
        "keys not listed have floor 0, so no client jumps ahead of the default by itself.",
    )
    open_paths_per_second: float = Field(
        50,
        gt=0,
        le=1_000_000,
        description="Requests per second each router replica answers on the paths open without "
        "a key (/health, /openapi.json, /docs); more get 429. Local to the replica, so probes "
        "never wait on the shared limiter; readiness probes need a handful per minute.",
    )
    max_body_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest request body, Content-Length or streamed; larger gets 413.",
    )
    max_header_bytes: int = Field(
        8 * 1024,
        ge=1024,
        le=1024**2,
        description="Largest total size of the request headers; larger gets 431.",
    )
    admin_keys: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Key names allowed on the admin routes (/v1/load_lora_adapter, "
        "/v1/unload_lora_adapter); other keys get 403. Without keys those routes are open "
        "wherever they are turned on (model.max_runtime_adapters).",
    )
    limits: RequestLimits = Field(default_factory=RequestLimits)
    allowed_chat_template_kwargs: list[TemplateFlag] = Field(
        default_factory=lambda: ["enable_thinking"],
        max_length=64,
        description="chat_template_kwargs keys a request may set (the flags your model's "
        "template reads; Qwen3's: enable_thinking). Any other key is a 400 naming it. "
        "Template parameters (chat_template, tokenize, tools, documents, ...) cannot be allowed.",
    )

    @field_validator("api_keys_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        # Replicas do not share the driver's working directory: relative paths would be a trap.
        if value is not None and not value.expanduser().is_absolute():
            raise ValueError(f"{value}: give an absolute path (replicas run elsewhere)")
        return value.expanduser() if value is not None else None

    @field_validator("key_rate_limits")
    @classmethod
    def _names(cls, value: dict[str, KeyRateLimit]) -> dict[str, KeyRateLimit]:
        for name in value:
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a key name ([A-Za-z0-9_.-], 1-64 chars)")
        return value

    @field_validator("key_batch_queue_tokens")
    @classmethod
    def _queue_names(cls, value: dict[str, int]) -> dict[str, int]:
        for name, tokens in value.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a key name ([A-Za-z0-9_.-], 1-64 chars)")
            if tokens < 1:
                raise ValueError(f"{name}: {tokens} tokens; give at least 1")
        return value

    @field_validator("admin_keys")
    @classmethod
    def _admin_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a key name ([A-Za-z0-9_.-], 1-64 chars)")
        return value

    @field_validator("key_priorities")
    @classmethod
    def _priorities(cls, value: dict[str, int]) -> dict[str, int]:
        for name, floor in value.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a key name ([A-Za-z0-9_.-], 1-64 chars)")
            if not -(2**31) <= floor < 2**31:
                raise ValueError(
                    f"{name}: {floor} is not a vLLM priority; give one between -2147483648 "
                    "and 2147483647"
                )
        return value

    @field_validator("allowed_chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: list[TemplateFlag]) -> list[TemplateFlag]:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)} cannot be allowed: they choose or drive the template "
                "itself (set model.chat_template for another template)"
            )
        return value

    @property
    def rate_limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.key_rate_limits)

    def min_priority(self, key_name: str | None) -> int:
        """The lowest priority a request of this key runs at (0 unless key_priorities says)."""
        return self.key_priorities.get(key_name or "", 0)

    def batch_queue_tokens_for(self, name: str) -> int | None:
        return self.key_batch_queue_tokens.get(name, self.batch_queue_tokens)

    def rate_limit_for(self, name: str) -> KeyRateLimit:
        default = KeyRateLimit(
            requests_per_minute=self.requests_per_minute, tokens_per_minute=self.tokens_per_minute
        )
        return self.key_rate_limits.get(name, default)
