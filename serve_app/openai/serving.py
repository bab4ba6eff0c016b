"""Transport-free serving core shared by the chat and completions handlers.

``OpenAIServing`` takes two callables — preprocess and generate — so it runs the same behind
Ray Serve handles (production) and in unit tests with fakes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo, cancelled_by_callee, model_not_found
from serve_app.hops import (
    EngineRequest,
    EngineStep,
    LoraAdapter,
    PreprocessRequest,
    PreprocessResult,
    TokenizedPrompt,
)
from serve_app.openai.protocol import ModelCard, ModelList, PromptTokensDetails, UsageInfo

PreprocessFn = Callable[[PreprocessRequest], Awaitable[PreprocessResult]]
GenerateFn = Callable[[EngineRequest], AsyncIterator["EngineStep | ErrorInfo"]]
# The serving core of a model by the name a request puts in `model` (404 for an unknown one).
ServingFor = Callable[[str], "OpenAIServing"]
MERGE_QUEUE_PER_PROMPT = 2  # Steps a multi-prompt stream buffers per prompt.


@dataclass
class UsageCounter:
    """Token counts of one HTTP request across its prompts and choices."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _seen_prompts: set[int] = field(default_factory=set)

    def add(self, prompt_index: int, step: EngineStep) -> None:
        if prompt_index not in self._seen_prompts:
            self._seen_prompts.add(prompt_index)
            self.prompt_tokens += step.prompt_tokens
            self.cached_tokens += step.cached_tokens or 0
        self.completion_tokens += sum(len(chunk.token_ids) for chunk in step.chunks)

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


@dataclass
class RequestStats:
    """What one HTTP request did, filled in as it goes, plus the trace context it carries."""

    route: str
    model: str
    request_id: str = ""
    trace_context: dict[str, str] = field(default_factory=dict)
    # Keeps a conversation on one engine replica (see engine.routing.session_header).
    session_key: str | None = None
    tenant: str = ""  # The API key's name, for fair share in the engine.
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    usage: UsageCounter = field(default_factory=UsageCounter)
    finish_reasons: set[str] = field(default_factory=set)

    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def observe(self, prompt_index: int, step: EngineStep) -> None:
        if self.first_token_at is None and any(c.token_ids for c in step.chunks):
            self.first_token_at = time.perf_counter()
        self.usage.add(prompt_index, step)
        self.finish_reasons.update(c.finish_reason for c in step.chunks if c.finish_reason)


@dataclass
class Prepared:
    """A validated, tokenized request ready for the engine."""

    request_id: str
    created: int
    prompts: list[TokenizedPrompt]
    result: PreprocessResult
    priority: int
    stats: RequestStats


class OpenAIServing:
    def __init__(
        self,
        config: AppConfig,
        preprocess: PreprocessFn,
        generate: GenerateFn,
        lora: LoraAdapter | None = None,
    ) -> None:
        """``lora``: this serving runs one LoRA adapter of the model, served by its name."""
        self.config = config
        self.lora = lora
        self.model_name = lora.name if lora else config.model.public_name
        self._preprocess = preprocess
        self._generate = generate
        self._created = int(time.time())

    def for_adapter(self, lora: LoraAdapter) -> OpenAIServing:
        """The same model's serving core running ``lora``."""
        return OpenAIServing(self.config, self._preprocess, self._generate, lora=lora)

    def models(self, max_model_len: int | None = None) -> ModelList:
        model = self.config.model
        card = ModelCard(
            id=self.model_name,
            created=self._created,
            # vLLM's shape: an adapter's root is where it was loaded from, its parent the model.
            root=self.lora.path if self.lora else model.name,
            parent=model.public_name if self.lora else None,
            max_model_len=max_model_len,
        )
        return ModelList(data=[card])

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise model_not_found(model, [self.model_name])

    def for_model(self, model: str) -> OpenAIServing:
        """Itself, for its own model's name (a one-model directory); else 404."""
        self.check_model(model)
        return self

    async def prepare(
        self, request: PreprocessRequest, priority: int, stats: RequestStats
    ) -> Prepared:
        stats.request_id = request.request_id
        if self.lora is not None:
            request = replace(request, adapter=self.lora.name)
        result = await self._preprocess(request)
        if result.error is not None:
            raise APIError.from_info(result.error)
        return Prepared(
            request.request_id, int(time.time()), result.prompts, result, priority, stats
        )

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def steps(
        self, prepared: Prepared, *, stream: bool = True
    ) -> AsyncIterator[tuple[int, EngineStep]]:
        """Engine steps of every prompt as (prompt index, step), interleaved as they come.

        ``stream=False`` asks the engine for one final step per prompt.
        """
        sampling = prepared.result.sampling
        assert sampling is not None
        requests = [
            EngineRequest(
                request_id=f"{prepared.request_id}-{i}",
                prompt_token_ids=prompt.token_ids,
                sampling=sampling,
                priority=prepared.priority,
                trace_context=prepared.stats.trace_context,
                stream=stream,
                block_hashes=prompt.block_hashes,
                session_key=prepared.stats.session_key,
                tenant=prepared.stats.tenant,
                lora=self.lora,
            )
            for i, prompt in enumerate(prepared.prompts)
        ]
        stats = prepared.stats
        if len(requests) == 1:  # The common case: no merging tasks, no queue.
            async for item in self._generate(requests[0]):
                step = _unwrap(item)
                stats.observe(0, step)
                yield 0, step
            return
        async for index, step in self._merged(requests):
            stats.observe(index, step)
            yield index, step

    async def _merged(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, EngineStep]]:
        # Bounded: a client that reads slowly holds back the pumps (and through them the
        # engine streams), instead of the router buffering every step of every prompt.
        queue: asyncio.Queue[tuple[int, EngineStep | ErrorInfo | BaseException | None]] = (
            asyncio.Queue(maxsize=MERGE_QUEUE_PER_PROMPT * len(requests))
        )

        async def pump(index: int, request: EngineRequest) -> None:
            try:
                async for item in self._generate(request):
                    await queue.put((index, item))
            except BaseException as exc:  # Surface it on the consumer side.
                await queue.put((index, exc))
                return
            await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, asyncio.CancelledError):  # The pump's callee's.
                    raise cancelled_by_callee(item) from None
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, _unwrap(item)
        finally:
            for task in tasks:
                task.cancel()


def _unwrap(item: EngineStep | ErrorInfo) -> EngineStep:
    if isinstance(item, ErrorInfo):
        raise APIError.from_info(item)
    return item


# Line separators JSON may carry raw inside strings but line readers split at (httpx's
# iter_lines, Python's str.splitlines): escaped, the same JSON, and one event stays one line.
LINE_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(payload: str) -> str:
    return f"data: {payload.translate(LINE_SEPARATORS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
