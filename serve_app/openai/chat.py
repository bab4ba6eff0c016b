"""POST /v1/chat/completions: request → preprocess → engine → full response or SSE stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from serve_app.errors import logged_error
from serve_app.hops import EngineStep, PreprocessRequest, TokenLogprob
from serve_app.openai.protocol import ChatCompletionRequest
from serve_app.openai.protocol.responses import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
    ChatLogprobs,
    TopLogprob,
    chat_chunk,
    dump,
)
from serve_app.openai.serving import OpenAIServing, Prepared, RequestStats
from serve_app.openai.sse import SSE_DONE, sse
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
    serving: OpenAIServing,
    request: ChatCompletionRequest,
    stats: RequestStats,
    request_id: str | None = None,
) -> ChatCompletion | AsyncIterator[str]:
    """``request_id``: given by callers that need a stable one (Batch API lines)."""
    serving = await serving.resolve(request.model)
    request_id = request_id or serving.new_request_id("chatcmpl")
    preprocess = to_preprocess_request(request, serving, request_id, stats.trace_context)
    prepared = await serving.prepare(preprocess, request.priority, stats)
    steps = serving.steps(prepared, stream=request.stream)
    if not request.stream:
        return await _collect(serving, prepared, steps, request)
    # Wait (up to sse_keepalive_s) for the first engine step before answering, so early
    # engine errors get a real status.
    first, steps = await serving.start_stream(steps)
    return _stream(serving, prepared, request, first, steps)


def _tool_delta(
    stream: ToolStream, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    content, calls = stream.feed(text)
    if finish_reason is not None:
        tail, more = stream.finish()
        content, calls = (content or "") + (tail or "") or None, calls + more
        if stream.calls:
            finish_reason = "tool_calls"
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta, finish_reason


def _chat_logprobs(items: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if items is None:
        return None
    return ChatLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token=item.token,
                logprob=item.logprob,
                bytes=list(item.token.encode()),
                top_logprobs=[
                    TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                    for t in item.top
                ],
            )
            for item in items
        ]
    )


def _tools_active(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def _message(text: str, request: ChatCompletionRequest) -> ChatCompletionMessage:
    content: str | None = text
    calls = []
    if _tools_active(request) and request.forces_tool_call:
        assert request.tool_choice is not None
        calls = parse_forced(text, request.tool_choice)
        content = None if calls else text
    elif _tools_active(request):
        content, calls = parse_auto(text)
    message = ChatCompletionMessage(role="assistant", content=content)
    if calls:
        message.tool_calls = list(calls)
    return message


async def _collect(
    serving: OpenAIServing,
    prepared: Prepared,
    steps: AsyncIterator[tuple[int, EngineStep]],
    request: ChatCompletionRequest,
) -> ChatCompletion:
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
    choices = []
    for i in range(n):
        message = _message("".join(texts[i]), request)
        reason = "tool_calls" if message.tool_calls else finish[i]
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=_chat_logprobs(logprobs[i]),
                finish_reason=reason,
            )
        )
    return ChatCompletion(
        id=prepared.request_id,
        object="chat.completion",
        created=prepared.created,
        model=serving.model_name,
        choices=choices,
        usage=usage.usage(),
    )


async def _stream(
    serving: OpenAIServing,
    prepared: Prepared,
    request: ChatCompletionRequest,
    first: tuple[int, EngineStep] | None,
    steps: AsyncIterator[tuple[int, EngineStep]],
) -> AsyncIterator[str]:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse(chat_chunk(prepared.request_id, created, serving.model_name, choices))

    usage = prepared.stats.usage
    tool_streams = (
        {i: ToolStream(request.tool_choice or "auto") for i in range(request.n)}
        if _tools_active(request)
        else None
    )
    yield chunk(
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(request.n)
        ]
    )
    try:
        # None: the first step took long, the response started without it (keep-alives).
        pending = first if first is not None else await anext(steps, None)
        while pending is not None:
            _, step = pending
            choices = []
            for c in step.chunks:
                delta: dict[str, Any] = {"content": c.text} if c.text else {}
                finish_reason = c.finish_reason
                if tool_streams is not None:
                    delta, finish_reason = _tool_delta(tool_streams[c.index], c.text, finish_reason)
                if delta or finish_reason or c.logprobs:
                    logprobs = _chat_logprobs(c.logprobs)
                    choices.append(
                        {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": None if logprobs is None else dump(logprobs),
                            "finish_reason": finish_reason,
                        }
                    )
            if choices:
                yield chunk(choices)
            pending = await anext(steps, None)
    except Exception as exc:
        # Headers are sent: the error travels as an SSE event, then [DONE].
        yield sse(json.dumps(logged_error(exc).body()))
    if include_usage:
        final = chat_chunk(prepared.request_id, created, serving.model_name, [], usage.usage())
        yield sse(final)
    yield SSE_DONE
