"""Small typed messages that travel between deployments.

HTTP/OpenAI models stop at the router; these plain dataclasses are what crosses each hop
(router → preprocessor → router → engine), so every hop carries only what the next stage needs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from serve_app.errors import ErrorInfo

_M64 = (1 << 64) - 1


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
    # time.time_ns() when the router sent it: the @serve.batch wait starts here.
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
class AdapterRef:
    """A LoRA adapter as engines load it: the name clients use, its source (absolute directory
    or hub id) and a generation that changes whenever the name is (re)loaded with other
    weights, so no engine reuses weights or prefix-cache blocks of an earlier load."""

    name: str
    source: str
    generation: int = 0

    @property
    def key(self) -> str:
        return f"{self.name}@{self.generation}"

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """What the engine's request router reads to route a load of this adapter: the same
        key its requests carry first, so the load lands where the adapter's traffic goes."""
        return (adapter_block(self),)


def adapter_block(adapter: AdapterRef) -> int:
    """A 64-bit routing block standing for "holds this adapter", the same in every process."""
    digest = hashlib.blake2b(adapter.key.encode(), digest_size=8, person=b"lora").digest()
    return int.from_bytes(digest, "little")


def adapter_hashes(adapter: AdapterRef | None, hashes: tuple[int, ...]) -> tuple[int, ...]:
    """A prompt's routing blocks under an adapter: the adapter's own block first (so even a
    short prompt goes where the adapter is loaded), then the prompt's blocks keyed by the
    adapter (vLLM caches an adapter's KV blocks apart from the base model's, and so does the
    routing index). The base model's blocks are unchanged."""
    if adapter is None:
        return hashes
    block = adapter_block(adapter)
    return (block, *(((h ^ block) * 0x9E3779B97F4A7C15) & _M64 for h in hashes))


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
    # Who asked (the API key's name; "" without keys): the engine shares its slots fairly.
    tenant: str = ""
    # The LoRA adapter to run with (None: the base model).
    lora: AdapterRef | None = None
    # Set by a caller with a step inbox (streams only): the engine sends this request's
    # steps there, keyed by ``reply_key`` and batched with the caller's other requests, one
    # message per engine step; the handle call then carries only errors.
    reply_to: str = ""
    reply_key: str = ""

    @property
    def prompt(self) -> str:
        """The token ids as text, one character per token id: what Ray Serve LLM's
        PrefixCacheAffinityRouter (policy ray_prefix_cache) matches prefixes on."""
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


# The step channel's wire format: plain lists of plain values (msgpack), never pickle, so a
# frame from anyone who reaches the socket can only be data.
def encode_step(step: EngineStep) -> list[Any]:
    chunks = [
        [c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, _encode_lp(c.logprobs)]
        for c in step.chunks
    ]
    return [chunks, step.prompt_tokens, step.cached_tokens, step.finished, step.timings]


def decode_step(data: list[Any]) -> EngineStep:
    chunks, prompt_tokens, cached_tokens, finished, timings = data
    return EngineStep(
        chunks=[
            EngineChunk(index, text, token_ids, finish, stop, _decode_lp(logprobs))
            for index, text, token_ids, finish, stop, logprobs in chunks
        ],
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        finished=finished,
        timings=None if timings is None else tuple(timings),
    )


def _encode_lp(logprobs: list[TokenLogprob] | None) -> list[Any] | None:
    if logprobs is None:
        return None
    return [[lp.token, lp.logprob, [[t.token, t.logprob] for t in lp.top]] for lp in logprobs]


def _decode_lp(data: list[Any] | None) -> list[TokenLogprob] | None:
    if data is None:
        return None
    return [TokenLogprob(t, lp, tuple(TopLogprob(*top) for top in tops)) for t, lp, tops in data]


# Batch API lines carry a deterministic request id, so an engine recognizes a line sent again
# by a coordinator that took a batch over (it joins or replays it instead of running it twice)
# and counts the lines it completed per batch.
_BATCH_LINE = re.compile(r"-bl_(batch-[0-9a-f]+)_([0-9]+)(?:-|$)")


def batch_line_request_id(prefix: str, batch_id: str, line: int) -> str:
    """Request id of input line ``line`` of ``batch_id`` (e.g. ``chatcmpl-bl_batch-…_12``)."""
    return f"{prefix}-bl_{batch_id}_{line}"


def batch_of_request(request_id: str) -> str | None:
    """The batch id a batch line's (engine) request id belongs to; None for other requests."""
    match = _BATCH_LINE.search(request_id)
    return None if match is None else match.group(1)
