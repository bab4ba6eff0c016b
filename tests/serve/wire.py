"""Every chat / completion body the serve tier's clients receive, checked against the ``openai``
SDK's own types in strict mode with no unknown fields: the wire format cannot drift from OpenAI's.

The SDK's models tolerate missing optional fields and keep unknown ones; a strict client does
not. ``check_body`` validates with ``strict=True`` and then walks the result for extras. The
transports below run the check on every response as it streams (nothing buffered), so a test
that reads a bad chunk fails with the chunk named.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
from openai import BaseModel
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs


class _EchoLogprobs(Logprobs):
    # With echo, OpenAI (and vLLM) send null for the first prompt token, which has no logprob;
    # the SDK's type declares lists of numbers and of dicts.
    token_logprobs: list[float | None] | None = None  # type: ignore[assignment]
    top_logprobs: list[dict[str, float] | None] | None = None  # type: ignore[assignment]


class _CompletionChoice(CompletionChoice):
    logprobs: _EchoLogprobs | None = None  # type: ignore[assignment]


class _StreamedCompletionChoice(_CompletionChoice):
    # OpenAI streams text_completion chunks with "finish_reason": null until the last; the
    # SDK's type (made for whole responses) declares it non-null.
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class _Completion(Completion):
    choices: list[_CompletionChoice]  # type: ignore[assignment]


class _StreamedCompletion(Completion):
    choices: list[_StreamedCompletionChoice]  # type: ignore[assignment]


# Path suffix -> (non-streamed type, streamed chunk type).
SHAPES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/completions": (_Completion, _StreamedCompletion),
}


class WireFormatError(AssertionError):
    """A body that a strict OpenAI client would reject."""


def _extras(value: Any, where: str = "") -> list[str]:
    """Paths of fields the SDK's types do not declare."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        found += [f"{where}.{name}" for name in value.model_extra or {}]
        for name in type(value).model_fields:
            found += _extras(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _extras(item, f"{where}[{i}]")
    return found


def check_body(path: str, text: str, *, streamed: bool) -> None:
    """Raise WireFormatError unless ``text`` parses strictly as the SDK type for ``path``."""
    shape = next((types for suffix, types in SHAPES.items() if path.endswith(suffix)), None)
    if shape is None or '"error"' in text[:20]:
        return  # Other routes, and OpenAI-style error bodies (checked by the error tests).
    model = shape[1] if streamed else shape[0]
    try:
        parsed = model.model_validate_json(text, strict=True)
    except ValueError as exc:
        raise WireFormatError(f"{path}: not a strict {model.__name__}: {exc}\n{text}") from exc
    if extras := _extras(parsed):
        raise WireFormatError(f"{path}: fields {model.__name__} lacks: {extras}\n{text}")


class _SSEChecker:
    """Splits a byte stream into SSE events and checks each ``data:`` payload."""

    def __init__(self, path: str) -> None:
        self.path, self.buffer = path, b""

    def feed(self, data: bytes) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            # Only \n ends an SSE line here (str.splitlines would also split at U+2028 and
            # other separators a generated text may hold).
            for line in event.decode().split("\n"):
                if line.startswith("data:") and (payload := line[5:].strip()) != "[DONE]":
                    check_body(self.path, payload, streamed=True)


def _checked(request: httpx.Request, response: httpx.Response) -> httpx.Response:
    """``response`` with a stream that checks what passes through it."""
    path = request.url.path
    if not any(path.endswith(suffix) for suffix in SHAPES) or response.status_code != 200:
        return response
    sse = response.headers.get("content-type", "").startswith("text/event-stream")
    stream = response.stream
    checker = _SSEChecker(path)
    body = bytearray()

    def take(chunk: bytes) -> None:
        if sse:
            checker.feed(chunk)
        else:
            body.extend(chunk)

    def done() -> None:
        if not sse:
            check_body(path, body.decode(), streamed=False)

    class SyncStream(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            for chunk in stream:  # type: ignore[union-attr]
                take(chunk)
                yield chunk
            done()

        def close(self) -> None:
            stream.close()  # type: ignore[union-attr]

    class AsyncStream(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in stream:  # type: ignore[union-attr]
                take(chunk)
                yield chunk
            done()

        async def aclose(self) -> None:
            await stream.aclose()  # type: ignore[union-attr]

    wrapped = AsyncStream() if isinstance(stream, httpx.AsyncByteStream) else SyncStream()
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=wrapped,
        request=request,
        extensions=response.extensions,
    )


# The pool of the SDK's own default client: httpx's default (100 connections) would queue the
# tests' floods of concurrent streams inside the client instead of sending them.
SDK_POOL = httpx.Limits(max_connections=1000, max_keepalive_connections=100)


class CheckedTransport(httpx.HTTPTransport):
    def __init__(self, limits: httpx.Limits = SDK_POOL) -> None:
        super().__init__(limits=limits)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return _checked(request, super().handle_request(request))


class AsyncCheckedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, limits: httpx.Limits = SDK_POOL) -> None:
        super().__init__(limits=limits)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return _checked(request, await super().handle_async_request(request))
