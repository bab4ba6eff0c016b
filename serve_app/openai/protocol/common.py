"""Shared pieces of the OpenAI protocol: base model, sampling fields, defaults precedence."""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config.model import GenerationDefaults
from serve_app.errors import APIError
from serve_app.hops import SamplingSpec

# vLLM samples greedily below this temperature, and then refuses n > 1.
GREEDY_TEMPERATURE = 1e-5

logger = logging.getLogger("serve_app.protocol")


class UnknownFieldLog:
    """Logs unknown field names once each, in bounded memory: clients choose the names (a 2 MiB
    body carries ~100k of them), so past ``max_names`` distinct names only a count is kept."""

    def __init__(self, max_names: int = 256, names_per_request: int = 5) -> None:
        self.max_names, self.names_per_request = max_names, names_per_request
        self.names: set[str] = set()
        self.unnamed = 0  # Unknown fields seen after the name set filled up.
        self._lock = threading.Lock()  # Requests are validated on several threads.

    def record(self, where: str, fields: list[str]) -> None:
        with self._lock:
            new = [name for name in fields if f"{where}.{name}" not in self.names]
            if not new:
                return
            named = new[: max(0, self.max_names - len(self.names))]
            self.names.update(f"{where}.{name}" for name in named)
            first_overflow = self.unnamed == 0 and len(new) > len(named)
            self.unnamed += len(new) - len(named)
        if not (named or first_overflow):
            return
        shown = ", ".join(repr(name[:64]) for name in new[: self.names_per_request])
        more = len(new) - self.names_per_request
        note = (
            f"; {self.max_names} distinct names logged, later ones are only counted"
            if first_overflow
            else ""
        )
        logger.warning(
            "Ignoring unknown fields in %s: %s%s%s",
            where,
            shown,
            f" and {more} more" if more > 0 else "",
            note,
        )


unknown_fields = UnknownFieldLog()


class OpenAIModel(BaseModel):
    """Base for requests: unknown fields are accepted and logged once, not fatal.

    Clients written for newer OpenAI or vLLM versions keep working; the log says what we ignored.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> OpenAIModel:
        if self.model_extra:
            unknown_fields.record(type(self).__name__, list(self.model_extra))
        return self


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopField = str | Annotated[list[str], Field(max_length=16)] | None


class SamplingFields(OpenAIModel):
    """Sampling fields common to chat and completions (OpenAI first, then vLLM extras)."""

    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: int = Field(1, ge=1, le=16)
    presence_penalty: Penalty | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StopField = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None
    # vLLM extras, accepted so clients written for `vllm serve` work unchanged.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    priority: int = Field(
        0,
        ge=-(2**31),
        lt=2**31,
        description="vLLM priority: lower values are scheduled first. A value below the API "
        "key's floor (0 unless the server's security.key_priorities says) is raised to it.",
    )

    @field_validator("logit_bias")
    @classmethod
    def _check_bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def _sampling_spec(
        self, defaults: GenerationDefaults, *, max_tokens: int | None, logprobs: int | None
    ) -> SamplingSpec:
        def pick(value: Any, default: Any, openai_default: Any) -> Any:
            if value is not None:
                return value
            return default if default is not None else openai_default

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        top_k = pick(self.top_k, defaults.top_k, 0)
        temperature = pick(self.temperature, defaults.temperature, 1.0)
        if self.n > 1 and temperature < GREEDY_TEMPERATURE:
            raise APIError(
                f"n must be 1 with greedy sampling (temperature {temperature}), got {self.n}: "
                "n greedy choices would all be the same text.",
                param="n",
            )
        return SamplingSpec(
            n=self.n,
            max_tokens=pick(max_tokens, defaults.max_tokens, None),
            temperature=temperature,
            top_p=pick(self.top_p, defaults.top_p, 1.0),
            top_k=0 if top_k == -1 else top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            logit_bias=_token_bias(self.logit_bias),
            logprobs=logprobs,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    return {int(key): value for key, value in bias.items()}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "serve_app"
    root: str | None = None
    parent: str | None = None  # vLLM's field: the base model of a LoRA adapter.
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
