"""POST /v1/chat/completions: request → preprocess → engine → full response or SSE stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from serve_app.errors import APIError
from serve_app.messages import EngineStep, PreprocessRequest, TokenLogprob
from serve_app.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprobOut,
)
from serve_app.serving import SSE_DONE, OpenAIServing, Prepared, UsageCounter, sse


def to_preprocess_request(
    request: ChatCompletionRequest, serving: OpenAIServing, request_id: str
) -> PreprocessRequest:
    return PreprocessRequest(
        request_id=request_id,
        kind="chat",
        sampling=request.to_sampling_spec(serving.config.model.generation_defaults),
        messages=[message.to_template_dict() for message in request.messages],
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs or {},
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        max_tokens_param=request.max_tokens_param,
    )


async def chat_completion(
    serving: OpenAIServing, request: ChatCompletionRequest
) -> ChatCompletionResponse | AsyncIterator[str]:
    serving.check_model(request.model)
    request_id = serving.new_request_id("chatcmpl")
    prepared = await serving.prepare(
        "chatcmpl", to_preprocess_request(request, serving, request_id), request.priority
    )
    steps = serving.steps(prepared)
    if not request.stream:
        return await _collect(serving, prepared, steps, request)
    # Wait for the first engine step before answering, so engine errors get a real status.
    first = await anext(steps)
    return _stream(serving, prepared, request, first, steps)


def _chat_logprobs(items: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if items is None:
        return None
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=item.token,
                logprob=item.logprob,
                bytes=list(item.token.encode()),
                top_logprobs=[
                    TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                    for t in item.top
                ],
            )
            for item in items
        ]
    )


async def _collect(
    serving: OpenAIServing,
    prepared: Prepared,
    steps: AsyncIterator[tuple[int, EngineStep]],
    request: ChatCompletionRequest,
) -> ChatCompletionResponse:
    n = request.n
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    finish: list[str | None] = [None] * n
    usage = UsageCounter()
    async for prompt_index, step in steps:
        usage.add(prompt_index, step)
        for chunk in step.chunks:
            texts[chunk.index].append(chunk.text)
            if chunk.logprobs is not None:
                logprobs[chunk.index] = (logprobs[chunk.index] or []) + chunk.logprobs
            if chunk.finish_reason:
                finish[chunk.index] = chunk.finish_reason
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content="".join(texts[i])),
            logprobs=_chat_logprobs(logprobs[i]),
            finish_reason=finish[i],
        )
        for i in range(n)
    ]
    return ChatCompletionResponse(
        id=prepared.request_id,
        created=prepared.created,
        model=serving.model_name,
        choices=choices,
        usage=usage.usage(),
    )


async def _stream(
    serving: OpenAIServing,
    prepared: Prepared,
    request: ChatCompletionRequest,
    first: tuple[int, EngineStep],
    steps: AsyncIterator[tuple[int, EngineStep]],
) -> AsyncIterator[str]:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice]) -> str:
        return sse(
            ChatCompletionChunk(
                id=prepared.request_id,
                created=created,
                model=serving.model_name,
                choices=choices,
            ).model_dump_json(exclude_unset=True)
        )

    usage = UsageCounter()
    yield chunk(
        [
            ChatChunkChoice(
                index=i, delta=DeltaMessage(role="assistant", content=""), finish_reason=None
            )
            for i in range(request.n)
        ]
    )
    try:
        pending: tuple[int, EngineStep] | None = first
        while pending is not None:
            prompt_index, step = pending
            usage.add(prompt_index, step)
            choices = [
                ChatChunkChoice(
                    index=c.index,
                    delta=DeltaMessage(content=c.text),
                    logprobs=_chat_logprobs(c.logprobs),
                    finish_reason=c.finish_reason,
                )
                for c in step.chunks
                if c.text or c.finish_reason or c.logprobs
            ]
            if choices:
                yield chunk(choices)
            pending = await anext(steps, None)
    except APIError as exc:
        yield sse(json.dumps(exc.info.body()))
    if include_usage:
        final = ChatCompletionChunk(
            id=prepared.request_id,
            created=created,
            model=serving.model_name,
            choices=[],
            usage=usage.usage(),
        )
        yield sse(final.model_dump_json())
    yield SSE_DONE
