"""Tenants through the serving core: priority floors per key, the key's name on every engine
request, and multi-prompt streams that a slow reader cannot make the router buffer (fakes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request

from serve_app.config import AppConfig
from serve_app.config.security import SecurityConfig
from serve_app.errors import ErrorInfo
from serve_app.hops import (
    EngineChunk,
    EngineRequest,
    EngineStep,
    PreprocessRequest,
    PreprocessResult,
    TokenizedPrompt,
)
from serve_app.ingress.tenancy import clamp_priority, tenant_of
from serve_app.openai import completions
from serve_app.openai.protocol import CompletionRequest
from serve_app.openai.serving import MERGE_QUEUE_STEPS, OpenAIServing, RequestStats


def completion(**extra: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "smollm2-135m-instruct", **extra})


@pytest.mark.parametrize(
    ("tenant", "requested", "expected"),
    [
        ("", -(2**31), 0),  # No keys: nobody jumps the queue.
        ("alice", -5, 0),
        ("alice", 7, 7),
        ("ops", -50, -10),  # Allowed down to -10.
        ("ops", -3, -3),
        ("bulk", 0, 100),  # Kept in the background.
        ("bulk", 150, 150),
    ],
)
def test_priority_is_raised_to_the_keys_floor(tenant: str, requested: int, expected: int) -> None:
    security = SecurityConfig(key_priorities={"ops": -10, "bulk": 100})
    body = completion(prompt="x", priority=requested)
    clamp_priority(body, tenant, security)
    assert body.priority == expected


def test_the_tenant_is_the_key_name_the_middleware_matched() -> None:
    scope: dict[str, Any] = {"type": "http", "headers": [], "state": {"api_key_name": "alice"}}
    assert tenant_of(Request(scope)) == "alice"
    assert tenant_of(Request({"type": "http", "headers": []})) == ""


async def _preprocess(request: PreprocessRequest) -> PreprocessResult:
    prompts = [TokenizedPrompt([1, 2], str(p)) for p in request.prompts or []]
    return PreprocessResult(prompts=prompts, sampling=request.sampling.with_max_tokens(1000))


class Engine:
    """Endless token streams that count how far ahead of the reader they got."""

    def __init__(self) -> None:
        self.produced = 0
        self.tenants: set[str] = set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        self.tenants.add(request.tenant)
        for _ in range(1000):
            self.produced += 1
            yield EngineStep([EngineChunk(0, "x", [1])], prompt_tokens=2)
            await asyncio.sleep(0)


async def test_a_slow_reader_holds_the_engine_streams_back() -> None:
    engine = Engine()
    serving = OpenAIServing(AppConfig(), _preprocess, engine.generate)
    stats = RequestStats("/v1/completions", "m", tenant="alice")
    stream = await completions.completion(
        serving, completion(prompt=[f"p{i}" for i in range(16)], stream=True), stats
    )
    assert isinstance(stream, AsyncIterator)
    read = 0
    async for _ in stream:
        read += 1
        if read == 20:
            break
    for _ in range(200):  # Time for the producers to run ahead, were they unbounded.
        await asyncio.sleep(0)
    # Read 20, buffered at most the queue plus one blocked put per prompt: not 16,000.
    assert engine.produced <= 20 + MERGE_QUEUE_STEPS + 16
    assert engine.tenants == {"alice"}
    await stream.aclose()  # type: ignore[attr-defined]
