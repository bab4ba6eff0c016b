"""The hops: small typed messages that travel between deployments.

HTTP/OpenAI models stop at the router; these plain dataclasses are what crosses each hop
(router → preprocessor → router → engine), so every hop carries only what the next stage needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from serve_app.errors import ErrorInfo


@dataclass(frozen=True)
class StructuredSpec:
    """One structured-output constraint; ``param`` names the request field it came from."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    value: Any
    param: str


@dataclass(frozen=True)
class SamplingSpec:
    """Engine-neutral sampling parameters; the engine turns them into vLLM ``SamplingParams``.

    ``max_tokens`` is None until the preprocessor resolves it against the context window.
    """

    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured: StructuredSpec | None = None

    def with_max_tokens(self, max_tokens: int) -> SamplingSpec:
        return replace(self, max_tokens=max_tokens)


@dataclass(frozen=True)
class PreprocessRequest:
    """Router → preprocessor: what to render and tokenize, plus the sampling to validate."""

    request_id: str
    kind: Literal["chat", "completion"]
    sampling: SamplingSpec
    messages: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # Requested max_tokens as the client named it, for error messages.
    max_tokens_param: str = "max_tokens"
    # W3C trace context of the router's span (empty when tracing is off).
    trace_context: dict[str, str] = field(default_factory=dict)
    # The LoRA adapter's name, if any: its KV cache is its own, so its prefix hashes are too.
    adapter: str | None = None
    # time.time_ns() when the router sent it: the aggregation window's wait starts here.
    sent_at_ns: int = 0


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: list[int]
    text: str | None = None
    # Hashes of the block-aligned prefixes of token_ids, for cache-aware routing (may be empty).
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PreprocessResult:
    """Preprocessor → router: token ids per prompt and resolved sampling, or an error."""

    prompts: list[TokenizedPrompt] = field(default_factory=list)
    sampling: SamplingSpec | None = None
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter of the engine's model: its served name and where vLLM loads it from."""

    name: str
    path: str
    # Bumped by a runtime reload in place (same name): the engine loads it afresh.
    revision: int = 0


@dataclass(frozen=True)
class EngineRequest:
    """Router → engine: one prompt's token ids; the engine never tokenizes again."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)
    # False: the engine sends one final step instead of one per token (fewer hops per token).
    stream: bool = True
    # Read by the engine's request router: prefix hashes (empty: route by load) and the
    # conversation's session key (x-session-id header or the OpenAI `user` field).
    block_hashes: tuple[int, ...] = ()
    session_key: str | None = None
    # The API key's name ("" without keys): the engine shares its slots fairly between them.
    tenant: str = ""
    # The adapter to run the prompt with; None: the base model.
    lora: LoraAdapter | None = None
    # The caller's output channel id (``engine.channels``): stream through it if this replica
    # has it open. None: this call's own stream carries the steps.
    channel: str | None = None

    @property
    def prompt(self) -> str:
        """The token ids as text, one character per id: what Ray's PrefixCacheAffinityRouter
        matches prefixes on (routing policy ``ray_prefix_cache``)."""
        return "".join(map(chr, self.prompt_token_ids))


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class EngineChunk:
    """Engine → router: new output of one completion (``index`` < n) since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class EngineStep:
    """Engine → router: all chunks produced by one engine step for one request."""

    chunks: list[EngineChunk]
    prompt_tokens: int
    cached_tokens: int | None = None
    finished: bool = False
    # On the last step: vLLM's (queued, scheduled, first token, last token) monotonic stamps.
    timings: tuple[float, float, float, float] | None = None


@dataclass(frozen=True)
class OnChannel:
    """Engine → router, first item of a streamed call: its steps come through the caller's
    channel on ``replica``; this call's own stream ends when the request does."""

    replica: str


@dataclass(frozen=True)
class ChannelOffer:
    """Engine → router, first item of a streamed call that named a channel this replica does
    not have open: the steps follow on this call; open a channel to ``replica`` for the next."""

    replica: str


@dataclass(frozen=True)
class ChannelOpen:
    """Router → engine: open the caller's output channel on ``target_replica`` (the engine
    request router sends the call there and nowhere else)."""

    caller: str
    target_replica: str
