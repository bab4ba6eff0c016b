"""Security settings: API keys, per-key rate limits, request size and shape limits.

Keys come from an environment variable and/or a file (never from the Serve config, which the
Ray dashboard shows). Only SHA-256 digests are kept in memory, every presented key is compared
against every stored digest with ``hmac.compare_digest``, and logs only ever name a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve_app.errors import APIError
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("serve_app.security")

NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Printable ASCII without spaces or commas: a key must survive an HTTP header and the env list.
_KEY_RE = re.compile(r"[\x21-\x2b\x2d-\x7e]{8,512}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KeyRateLimit(_Strict):
    """Per-minute budgets of one key (sliding 60 s window, shared by all router replicas)."""

    requests_per_minute: int | None = Field(
        None, ge=1, le=10_000_000, description="Requests per minute per key; unset: unlimited."
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=10**12,
        description="Tokens per minute per key, charged up front: the prompt estimate "
        "(characters / 4, or the token ids) plus n × max_tokens; unset: unlimited.",
    )


class RequestLimits(_Strict):
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
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        le=10**9,
        description="Most prompt characters (all message contents, or all prompts; a token id "
        "counts as one); unset: bounded by max_body_bytes and the context window.",
    )


class SecurityConfig(_Strict):
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
        description="Completion tokens charged to tokens_per_minute when a chat request sets "
        "no max_tokens (completions default to 16, as in OpenAI's API).",
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
    limits: RequestLimits = Field(default_factory=RequestLimits)

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

    @property
    def rate_limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.key_rate_limits)

    def rate_limit_for(self, name: str) -> KeyRateLimit:
        default = KeyRateLimit(
            requests_per_minute=self.requests_per_minute, tokens_per_minute=self.tokens_per_minute
        )
        return self.key_rate_limits.get(name, default)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class KeyRing:
    """Named API keys, held as SHA-256 digests so every comparison has the same length."""

    names: tuple[str, ...] = ()
    digests: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, presented: bytes) -> str | None:
        """The name of the key presented, or None; compares against every key, no early exit."""
        digest = _digest(presented)
        hits = [hmac.compare_digest(digest, stored) for stored in self.digests]
        return next((name for name, hit in zip(self.names, hits, strict=True) if hit), None)


def parse_keys(entries: list[str], source: str) -> list[tuple[str, str]]:
    """(name, key) pairs from `name:key` or bare-key entries; bare keys are named source-N."""
    pairs = []
    for index, raw in enumerate(entries, start=1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        name, sep, key = entry.partition(":")
        if not (sep and NAME_RE.fullmatch(name)):
            name, key = f"{source}-{index}", entry
        if not _KEY_RE.fullmatch(key):
            # The message names the entry, never the key itself.
            raise ValueError(
                f"API key {name!r} from {source}: keys are 8-512 printable ASCII characters "
                "without spaces or commas"
            )
        pairs.append((name, key))
    return pairs


def load_keys(config: SecurityConfig, environ: Mapping[str, str] | None = None) -> KeyRing:
    environ = os.environ if environ is None else environ
    pairs = parse_keys(environ.get(config.api_keys_env, "").split(","), "env")
    if config.api_keys_file is not None:
        path = config.api_keys_file
        try:
            text = path.read_text()
            mode = path.stat().st_mode
        except OSError as exc:
            raise ValueError(f"security.api_keys_file {path}: {exc.strerror}") from exc
        if mode & 0o077:
            logger.warning("API key file %s is readable by others; chmod 600 it", path)
        pairs += parse_keys(text.splitlines(), "file")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"duplicate API key names: {sorted({n for n in names if names.count(n) > 1})}"
        )
    digests = [_digest(key.encode()) for _, key in pairs]
    if len(set(digests)) != len(digests):
        raise ValueError("the same API key is listed twice (under different names)")
    if not pairs:
        logger.warning(
            "No API keys configured (%s, api_keys_file): /v1 is open", config.api_keys_env
        )
    for name in config.key_rate_limits:
        if name not in names:
            logger.warning("security.key_rate_limits names unknown key %r", name)
    return KeyRing(tuple(names), tuple(digests))


def _above(param: str, value: int, limit: int, what: str = "integer") -> APIError:
    kind = {"integer": "value", "array": "length", "string": "length"}[what]
    return APIError(
        f"Invalid '{param}': {what} above maximum {kind}. Expected a {kind} <= {limit}, "
        f"but got {value} instead.",
        param=param,
        code=f"{what}_above_max_{kind}",
    )


def _text_len(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # Content parts, prompts, or token ids (one char each).
        return sum(_text_len(getattr(part, "text", part)) for part in content)
    return 1 if isinstance(content, int) else 0


def check_limits(body: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """Reject requests beyond the operator's limits with 400 and the exact `param`."""
    if body.n > limits.max_n:
        raise _above("n", body.n, limits.max_n)
    cap = limits.max_tokens_cap
    for param in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, param, None)
        if cap is not None and isinstance(value, int) and value > cap:
            raise _above(param, value, cap)
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > limits.max_messages:
            raise _above("messages", len(body.messages), limits.max_messages, "array")
        tools = body.tools or []
        if len(tools) > limits.max_tools:
            raise _above("tools", len(tools), limits.max_tools, "array")
        param, chars = "messages", sum(_text_len(m.content) for m in body.messages)
    else:
        param, chars = "prompt", _text_len(body.prompt)
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise _above(param, chars, limits.max_prompt_chars, "string")
