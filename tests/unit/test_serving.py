"""The serving core with fake preprocess/engine callables: response assembly, SSE, usage.

Fakes are only for this layer; the serve tier runs the same code on real Ray + vLLM.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import (
    EngineChunk,
    EngineRequest,
    EngineStep,
    PreprocessRequest,
    PreprocessResult,
    TokenizedPrompt,
)
from serve_app.openai import chat, completions
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.openai.serving import OpenAIServing, RequestStats
from tests.serve.wire import WireFormatError, check_body

WORDS = ["Hello", " there", "!"]


async def fake_preprocess(request: PreprocessRequest) -> PreprocessResult:
    if request.kind == "chat":
        prompts = [TokenizedPrompt([1, 2, 3], "chat")]
    else:
        prompts = [
            TokenizedPrompt([7] * (i + 1), str(p)) for i, p in enumerate(request.prompts or [])
        ]
    return PreprocessResult(prompts=prompts, sampling=request.sampling.with_max_tokens(3))


async def fake_generate(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
    for position, word in enumerate(WORDS):
        last = position == len(WORDS) - 1
        chunks = [
            EngineChunk(
                index=i, text=word, token_ids=[position], finish_reason="length" if last else None
            )
            for i in range(request.sampling.n)
        ]
        yield EngineStep(
            chunks, prompt_tokens=len(request.prompt_token_ids), cached_tokens=1, finished=last
        )


def serving(generate=fake_generate, preprocess=fake_preprocess) -> OpenAIServing:  # type: ignore[no-untyped-def]
    return OpenAIServing(AppConfig(), preprocess, generate)


def chat_request(**extra: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], **extra}
    )


async def test_chat_full_response_with_n_and_usage() -> None:
    response = await chat.chat_completion(serving(), chat_request(n=2), RequestStats("chat", "m"))
    assert not isinstance(response, AsyncIterator)
    assert [c.message.content for c in response.choices] == ["Hello there!"] * 2
    assert [c.finish_reason for c in response.choices] == ["length", "length"]
    assert response.usage.prompt_tokens == 3 and response.usage.completion_tokens == 6
    assert response.usage.total_tokens == 9
    assert response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 1


async def _events(stream: AsyncIterator[str]) -> list[str]:
    return [line async for line in stream]


async def test_chat_stream_is_sse_with_role_first_usage_last_and_done() -> None:
    stream = await chat.chat_completion(
        serving(),
        chat_request(stream=True, stream_options={"include_usage": True}),
        RequestStats("chat", "m"),
    )
    assert isinstance(stream, AsyncIterator)
    events = await _events(stream)
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert bodies[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(b["choices"][0]["delta"].get("content", "") for b in bodies if b["choices"])
    assert text == "Hello there!"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 3


async def test_completion_multi_prompt_indexes_and_echo() -> None:
    request = CompletionRequest.model_validate(
        {"model": "smollm2-135m-instruct", "prompt": ["a", "b"], "n": 2, "echo": True}
    )
    response = await completions.completion(serving(), request, RequestStats("cmpl", "m"))
    assert not isinstance(response, AsyncIterator)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == ["aHello there!"] * 2 + ["bHello there!"] * 2
    assert response.usage is not None and response.usage.prompt_tokens == 1 + 2


async def test_unknown_model_is_404() -> None:
    with pytest.raises(APIError) as info:
        await chat.chat_completion(
            serving(), chat_request(model="gpt-9"), RequestStats("chat", "m")
        )
    assert info.value.info.status == 404 and info.value.info.code == "model_not_found"


async def test_preprocess_error_surfaces_before_any_engine_call() -> None:
    calls = []

    async def rejecting(request: PreprocessRequest) -> PreprocessResult:
        return PreprocessResult(
            error=ErrorInfo("too long", param="messages", code="context_length_exceeded")
        )

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        calls.append(request)
        yield ErrorInfo("unreachable")

    with pytest.raises(APIError) as info:
        await chat.chat_completion(
            serving(generate, rejecting), chat_request(), RequestStats("chat", "m")
        )
    assert info.value.info.code == "context_length_exceeded" and calls == []


async def test_engine_error_before_first_token_raises_and_mid_stream_becomes_event() -> None:
    async def dead(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        yield ErrorInfo("engine died", status=503, type="server_error")

    with pytest.raises(APIError) as info:
        await chat.chat_completion(
            serving(dead), chat_request(stream=True), RequestStats("chat", "m")
        )
    assert info.value.info.status == 503

    async def dies_later(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        yield EngineStep([EngineChunk(0, "Hi", [1])], prompt_tokens=3)
        yield ErrorInfo("engine died", status=503, type="server_error")

    stream = await chat.chat_completion(
        serving(dies_later), chat_request(stream=True), RequestStats("chat", "m")
    )
    assert isinstance(stream, AsyncIterator)
    events = await _events(stream)
    assert json.loads(events[-2][6:])["error"]["message"] == "engine died"
    assert events[-1] == "data: [DONE]\n\n"


@pytest.mark.parametrize("include_usage", [True, False])
async def test_streamed_chat_chunks_are_strict_openai_chunks(include_usage: bool) -> None:
    """Each chunk parses as the SDK's ChatCompletionChunk in strict mode, `object` included."""
    stream = await chat.chat_completion(
        serving(),
        chat_request(n=2, stream=True, stream_options={"include_usage": include_usage}),
        RequestStats("chat", "m"),
    )
    assert isinstance(stream, AsyncIterator)
    bodies = [e[len("data: ") :].strip() for e in await _events(stream)][:-1]
    for body in bodies:
        check_body("/v1/chat/completions", body, streamed=True)
        assert json.loads(body)["object"] == "chat.completion.chunk"
        assert ("usage" in json.loads(body)) is include_usage
    full = await chat.chat_completion(serving(), chat_request(), RequestStats("chat", "m"))
    assert not isinstance(full, AsyncIterator)
    check_body("/v1/chat/completions", full.model_dump_json(), streamed=False)


def test_the_strict_check_rejects_what_lenient_sdk_parsing_accepts() -> None:
    chunk = {
        "id": "c",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
    }
    with pytest.raises(WireFormatError, match="object"):  # The chunks before this check.
        check_body("/v1/chat/completions", json.dumps(chunk), streamed=True)
    chunk |= {"object": "chat.completion.chunk", "surprise": 1}
    with pytest.raises(WireFormatError, match="surprise"):
        check_body("/v1/chat/completions", json.dumps(chunk), streamed=True)
    chunk.pop("surprise")
    check_body("/v1/chat/completions", json.dumps(chunk), streamed=True)


async def test_completions_full_and_streamed_are_strict_openai_completions() -> None:
    body = {"model": "smollm2-135m-instruct", "prompt": ["a", "b"], "n": 2, "logprobs": 2}
    full = await completions.completion(
        serving(), CompletionRequest.model_validate(body), RequestStats("cmpl", "m")
    )
    assert not isinstance(full, AsyncIterator)
    check_body("/v1/completions", full.model_dump_json(), streamed=False)
    stream = await completions.completion(
        serving(),
        CompletionRequest.model_validate(body | {"stream": True}),
        RequestStats("cmpl", "m"),
    )
    assert isinstance(stream, AsyncIterator)
    for event in (await _events(stream))[:-1]:
        check_body("/v1/completions", event[len("data: ") :].strip(), streamed=True)


async def test_a_slow_reader_holds_the_engine_streams_back_instead_of_buffering() -> None:
    """Multi-prompt streams merge through a bounded queue: 4 prompts of 1,000 steps each, a
    reader that has taken 3 steps, and the pumps have pulled only a few steps ahead."""
    import asyncio

    from serve_app.openai.serving import MERGE_QUEUE_PER_PROMPT

    pulled = 0

    async def endless(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        nonlocal pulled
        for position in range(1000):
            pulled += 1
            last = position == 999
            chunk = EngineChunk(0, "x", [position], "length" if last else None)
            yield EngineStep([chunk], prompt_tokens=1, finished=last)

    request = CompletionRequest.model_validate(
        {"model": "smollm2-135m-instruct", "prompt": ["a", "b", "c", "d"], "stream": True}
    )
    service = serving(generate=endless)
    preprocess = completions.to_preprocess_request(request, service, "cmpl-1", None)
    prepared = await service.prepare(preprocess, 0, RequestStats("cmpl", "m"))
    steps = service.steps(prepared)
    for _ in range(3):
        await steps.__anext__()
    for _ in range(50):  # Let every pump run as far as it can.
        await asyncio.sleep(0)
    assert pulled <= 3 + MERGE_QUEUE_PER_PROMPT * 4 + 4, pulled
    rest = [step async for step in steps]
    assert len(rest) == 4 * 1000 - 3


def test_sse_events_stay_one_line_for_every_line_reader() -> None:
    """A generated text may hold U+2028, U+2029 or U+0085: valid raw inside JSON, but httpx's
    iter_lines and str.splitlines end a line there. Escaped, the event is one line."""
    from serve_app.openai.serving import sse

    text = "a\u2028b\u2029c\x85d\x1ce"
    event = sse(json.dumps({"text": text}, ensure_ascii=False))
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: ") : -2]) == {"text": text}


@pytest.mark.parametrize("prompts", [["a"], ["a", "b", "c"]])
async def test_a_callee_cancel_mid_stream_ends_with_an_error_event_and_done(
    prompts: list[str],
) -> None:
    """Serve raises a replica-side cancel in the router as CancelledError: a stream (one
    prompt, or several merged) must still end with an error event and [DONE], not be cut."""
    import asyncio

    async def cut(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        yield EngineStep([EngineChunk(0, "Hi", [1])], prompt_tokens=3)
        if request.request_id.endswith("-0"):
            raise asyncio.CancelledError
        await asyncio.sleep(0.05)
        yield EngineStep([EngineChunk(0, "!", [2], finish_reason="stop")], finished=True)

    request = CompletionRequest.model_validate(
        {"model": "smollm2-135m-instruct", "prompt": prompts, "stream": True}
    )
    stream = await completions.completion(serving(cut), request, RequestStats("cmpl", "m"))
    assert isinstance(stream, AsyncIterator)
    events = await _events(stream)
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "engine_unavailable" and error["message"]
