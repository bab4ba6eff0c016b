"""POST /v1/chat/completions: request → preprocess → engine → full response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from pydantic import BaseModel

from serve_app.errors import cancelled_by_callee, cancelled_here, stream_error
from serve_app.hops import EngineStep, PreprocessRequest, TokenLogprob
from serve_app.openai.chunks import TextEvents
from serve_app.openai.protocol import (
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
from serve_app.openai.serving import SSE_DONE, OpenAIServing, Prepared, RequestStats, sse
from serve_app.openai.tools import ToolStream, parse_auto, parse_forced


def to_preprocess_request(
    request: ChatCompletionRequest,
    serving: OpenAIServing,
    request_id: str,
    trace_context: dict[str, str] | None = None,
) -> PreprocessRequest:
    return PreprocessRequest(
        request_id=request_id,
        trace_context=trace_context or {},
        sent_at_ns=time.time_ns(),
        kind="chat",
        sampling=request.to_sampling_spec(serving.config.model.generation_defaults),
        messages=[message.to_template_dict() for message in request.messages],
        tools=request.template_tools(),
        chat_template_kwargs=request.chat_template_kwargs or {},
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        max_tokens_param=request.max_tokens_param,
    )


async def chat_completion(
    serving: OpenAIServing, request: ChatCompletionRequest, stats: RequestStats
) -> ChatCompletionResponse | AsyncIterator[str]:
    serving.check_model(request.model)
    request_id = serving.new_request_id("chatcmpl")
    preprocess = to_preprocess_request(request, serving, request_id, stats.trace_context)
    prepared = await serving.prepare(preprocess, request.priority, stats)
    steps = serving.steps(prepared, stream=request.stream)
    if not request.stream:
        return await _collect(serving, prepared, steps, request)
    # Wait for the first engine step before answering, so engine errors get a real status.
    first = await anext(steps)
    return _stream(serving, prepared, request, first, steps)


def _tool_delta(
    stream: ToolStream, text: str, finish_reason: str | None
) -> tuple[DeltaMessage, str | None]:
    content, calls = stream.feed(text)
    if finish_reason is not None:
        tail, more = stream.finish()
        content, calls = (content or "") + (tail or "") or None, calls + more
        if stream.calls and finish_reason == "stop":  # A call cut by max_tokens stays "length".
            finish_reason = "tool_calls"
    return DeltaMessage(content=content, tool_calls=calls or None), finish_reason


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


def _tools_active(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def _message(text: str, request: ChatCompletionRequest) -> ChatResponseMessage:
    if not _tools_active(request):
        return ChatResponseMessage(content=text)
    if request.forces_tool_call:
        assert request.tool_choice is not None
        calls = parse_forced(text, request.tool_choice)
        return ChatResponseMessage(content=None if calls else text, tool_calls=calls or None)
    content, calls = parse_auto(text)
    return ChatResponseMessage(content=content, tool_calls=calls or None)


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
    usage = prepared.stats.usage
    async for _, step in steps:
        for chunk in step.chunks:
            texts[chunk.index].append(chunk.text)
            if chunk.logprobs is not None:
                logprobs[chunk.index] = (logprobs[chunk.index] or []) + chunk.logprobs
            if chunk.finish_reason:
                finish[chunk.index] = chunk.finish_reason
    choices = [
        ChatChoice(
            index=i,
            message=_message("".join(texts[i]), request),
            logprobs=_chat_logprobs(logprobs[i]),
            finish_reason=finish[i],
        )
        for i in range(n)
    ]
    for choice in choices:
        if choice.message.tool_calls and choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
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

    def model(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=prepared.request_id, created=created, model=serving.model_name, choices=choices
        )

    def dump(chunk_model: BaseModel) -> str:
        return chunk_model.model_dump_json(exclude=None if include_usage else {"usage"})

    def chunk(choices: list[ChatChunkChoice]) -> str:
        return sse(dump(model(choices)))

    text_events = TextEvents(
        lambda i, text: model([ChatChunkChoice(index=i, delta=DeltaMessage(content=text))]), dump
    )

    usage = prepared.stats.usage
    tool_streams = (
        {i: ToolStream(request.tool_choice or "auto") for i in range(request.n)}
        if _tools_active(request)
        else None
    )
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
            _, step = pending
            only = step.chunks[0] if tool_streams is None and len(step.chunks) == 1 else None
            if only and only.text and only.finish_reason is None and only.logprobs is None:
                yield text_events.event(only.index, only.text)  # Almost every token.
            elif choices := _chunk_choices(step, tool_streams):
                yield chunk(choices)
            pending = await anext(steps, None)
    except Exception as exc:
        # Headers are sent: the error travels as an SSE event, then [DONE].
        yield sse(json.dumps(stream_error(exc).body()))
    except asyncio.CancelledError as exc:
        if cancelled_here():  # The client went away.
            raise
        yield sse(json.dumps(cancelled_by_callee(exc).info.body()))
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


def _chunk_choices(
    step: EngineStep, tool_streams: dict[int, ToolStream] | None
) -> list[ChatChunkChoice]:
    """The stream chunk's choices for one engine step: those with anything to say."""
    choices = []
    for c in step.chunks:
        delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
        if tool_streams is not None:
            delta, finish_reason = _tool_delta(tool_streams[c.index], c.text, finish_reason)
        if delta.content or delta.tool_calls or finish_reason or c.logprobs:
            choices.append(
                ChatChunkChoice(
                    index=c.index,
                    delta=delta,
                    logprobs=_chat_logprobs(c.logprobs),
                    finish_reason=finish_reason,
                )
            )
    return choices
