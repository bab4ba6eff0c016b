"""POST /v1/completions: prompts (text or token ids) → engine → full response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from serve_app.errors import cancelled_by_callee, cancelled_here, stream_error
from serve_app.hops import EngineStep, PreprocessRequest, TokenLogprob
from serve_app.openai.chunks import TextEvents
from serve_app.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from serve_app.openai.serving import SSE_DONE, OpenAIServing, Prepared, RequestStats, sse


def to_preprocess_request(
    request: CompletionRequest,
    serving: OpenAIServing,
    request_id: str,
    trace_context: dict[str, str] | None = None,
) -> PreprocessRequest:
    return PreprocessRequest(
        request_id=request_id,
        trace_context=trace_context or {},
        sent_at_ns=time.time_ns(),
        kind="completion",
        sampling=request.to_sampling_spec(serving.config.model.generation_defaults),
        prompts=request.prompt_list(),
        echo=request.echo,
    )


async def completion(
    serving: OpenAIServing, request: CompletionRequest, stats: RequestStats
) -> CompletionResponse | AsyncIterator[str]:
    serving.check_model(request.model)
    request_id = serving.new_request_id("cmpl")
    preprocess = to_preprocess_request(request, serving, request_id, stats.trace_context)
    prepared = await serving.prepare(preprocess, request.priority, stats)
    steps = serving.steps(prepared, stream=request.stream)
    if not request.stream:
        return await _collect(serving, prepared, steps, request)
    first = await anext(steps)
    return _stream(serving, prepared, request, first, steps)


class _LogprobBuilder:
    """OpenAI's legacy completion logprobs: parallel lists plus running text offsets."""

    def __init__(self, start_offset: int) -> None:
        self.offset = start_offset
        self.value = CompletionLogprobs()

    def add(self, items: list[TokenLogprob]) -> CompletionLogprobs:
        delta = CompletionLogprobs()
        for item in items:
            for target in (self.value, delta):
                target.tokens.append(item.token)
                target.token_logprobs.append(item.logprob)
                target.top_logprobs.append({t.token: t.logprob for t in item.top} or None)
                target.text_offset.append(self.offset)
            self.offset += len(item.token)
        return delta


async def _collect(
    serving: OpenAIServing,
    prepared: Prepared,
    steps: AsyncIterator[tuple[int, EngineStep]],
    request: CompletionRequest,
) -> CompletionResponse:
    n = request.n
    total = n * len(prepared.prompts)
    texts: list[list[str]] = [[] for _ in range(total)]
    finish: list[str | None] = [None] * total
    builders: list[_LogprobBuilder | None] = [None] * total
    for prompt_index, prompt in enumerate(prepared.prompts):
        for i in range(n):
            echo = (prompt.text or "") if request.echo else ""
            texts[prompt_index * n + i].append(echo)
            if request.logprobs is not None:
                builders[prompt_index * n + i] = _LogprobBuilder(len(echo))
    usage = prepared.stats.usage
    async for prompt_index, step in steps:
        for chunk in step.chunks:
            index = prompt_index * n + chunk.index
            texts[index].append(chunk.text)
            builder = builders[index]
            if builder is not None and chunk.logprobs:
                builder.add(chunk.logprobs)
            if chunk.finish_reason:
                finish[index] = chunk.finish_reason
    choices = [
        CompletionChoice(
            index=i,
            text="".join(texts[i]),
            logprobs=builder.value if (builder := builders[i]) else None,
            finish_reason=finish[i],
        )
        for i in range(total)
    ]
    return CompletionResponse(
        id=prepared.request_id,
        created=prepared.created,
        model=serving.model_name,
        choices=choices,
        usage=usage.usage(),
    )


async def _stream(
    serving: OpenAIServing,
    prepared: Prepared,
    request: CompletionRequest,
    first: tuple[int, EngineStep],
    steps: AsyncIterator[tuple[int, EngineStep]],
) -> AsyncIterator[str]:
    n = request.n
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    created = int(time.time())
    echoed: set[int] = set()
    builders: dict[int, _LogprobBuilder] = {}
    usage = prepared.stats.usage

    def body(choices: list[CompletionChoice], **extra: object) -> str:
        response = CompletionResponse(
            id=prepared.request_id,
            created=created,
            model=serving.model_name,
            choices=choices,
            **extra,
        )
        return sse(response.model_dump_json(exclude_none=False))

    text_events = TextEvents(
        lambda i, text: CompletionResponse(
            id=prepared.request_id,
            created=created,
            model=serving.model_name,
            choices=[CompletionChoice(index=i, text=text)],
        ),
        lambda chunk_model: chunk_model.model_dump_json(exclude_none=False),
    )

    try:
        pending: tuple[int, EngineStep] | None = first
        while pending is not None:
            prompt_index, step = pending
            only = step.chunks[0] if len(step.chunks) == 1 and request.logprobs is None else None
            text_index = prompt_index * n + only.index if only else -1
            echoing = request.echo and text_index not in echoed
            if only and only.text and only.finish_reason is None and not echoing:
                yield text_events.event(text_index, only.text)  # Almost every token.
            else:
                choices = []
                for chunk in step.chunks:
                    index = prompt_index * n + chunk.index
                    text = chunk.text
                    if request.echo and index not in echoed:
                        echoed.add(index)
                        text = (prepared.prompts[prompt_index].text or "") + text
                    logprobs = None
                    if request.logprobs is not None and chunk.logprobs:
                        builder = builders.setdefault(index, _LogprobBuilder(0))
                        logprobs = builder.add(chunk.logprobs)
                    if text or chunk.finish_reason or logprobs:
                        choices.append(
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=chunk.finish_reason,
                            )
                        )
                if choices:
                    yield body(choices)
            pending = await anext(steps, None)
    except Exception as exc:
        # Headers are sent: the error travels as an SSE event, then [DONE].
        yield sse(json.dumps(stream_error(exc).body()))
    except asyncio.CancelledError as exc:
        if cancelled_here():  # The client went away.
            raise
        yield sse(json.dumps(cancelled_by_callee(exc).info.body()))
    if include_usage:
        yield body([], usage=usage.usage())
    yield SSE_DONE
