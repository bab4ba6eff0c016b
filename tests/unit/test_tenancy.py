"""Priority floors per key: a client's priority is raised to its key's floor (0 unless
security.key_priorities says otherwise), while the Batch API keeps its own background priority."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from serve_app.batch_api.service import BATCH_PRIORITY, BatchService
from serve_app.batch_api.store import BatchStore
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
from serve_app.ingress.router import Router
from serve_app.ingress.tenancy import allowed_priority, tenant_of
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.openai.serving import OpenAIServing

MODEL = "smollm2-135m-instruct"
SECURITY = SecurityConfig(key_priorities={"ops": -10, "nightly": 100})


def _request(key_name: str | None) -> Request:
    scope: dict[str, Any] = {"type": "http", "headers": []}
    if key_name is not None:  # The security middleware sets it only when keys are configured.
        scope["state"] = {"api_key_name": key_name}
    return Request(scope)


@pytest.mark.parametrize(
    ("tenant", "priority", "runs_at"),
    [
        ("", 0, 0),
        ("", 2**31 - 1, 2**31 - 1),
        ("", -1, 0),
        ("", -(2**31), 0),
        ("alice", -5, 0),
        ("alice", 100, 100),
        ("ops", -10, -10),
        ("ops", -11, -10),
        ("ops", 7, 7),
        ("nightly", 0, 100),
        ("nightly", 150, 150),
    ],
)
def test_a_priority_below_the_keys_floor_is_raised_to_it(
    tenant: str, priority: int, runs_at: int
) -> None:
    assert allowed_priority(priority, tenant, SECURITY) == runs_at


def test_the_tenant_is_the_key_name_the_middleware_matched() -> None:
    assert tenant_of(_request("ops")) == "ops"
    assert tenant_of(_request(None)) == ""  # No keys configured.


def test_the_router_raises_the_priority_of_both_generation_routes() -> None:
    # The method on a stand-in self: constructing a Router needs a running Serve replica.
    check = Router.func_or_class._check  # type: ignore[attr-defined]
    backends = SimpleNamespace(serving=lambda model: model)
    router = SimpleNamespace(config=AppConfig(security=SECURITY), backends=backends)
    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": -1}
    )
    completion = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "priority": -11})
    check(router, chat, _request("alice"))
    check(router, completion, _request("ops"))
    assert (chat.priority, completion.priority) == (0, -10)
    allowed = completion.model_copy(update={"priority": -3})
    check(router, allowed, _request("ops"))
    assert allowed.priority == -3


async def test_batch_lines_keep_their_background_priority(tmp_path: Path) -> None:
    """Internal callers are not clamped: a batch line runs at >= BATCH_PRIORITY whatever it
    asked for, never below it (and never refused for asking)."""
    seen: list[int] = []

    async def preprocess(request: PreprocessRequest) -> PreprocessResult:
        prompts = [TokenizedPrompt([1, 2], "p")]
        return PreprocessResult(prompts=prompts, sampling=request.sampling.with_max_tokens(1))

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        seen.append(request.priority)
        yield EngineStep([EngineChunk(0, "x", [1], "length")], prompt_tokens=2, finished=True)

    config = AppConfig()
    service = BatchService(
        OpenAIServing(config, preprocess, generate), config, BatchStore(tmp_path)
    )
    for asked in (-(2**31), 0, 150):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "priority": asked}
        status, _ = await service._call("/v1/completions", body)
        assert status == 200
    messages = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 1, "priority": -7}
    assert (await service._call("/v1/chat/completions", chat))[0] == 200
    assert seen == [BATCH_PRIORITY, BATCH_PRIORITY, 150, BATCH_PRIORITY]
    # A priority the model refuses is that line's 400 (it used to fail the whole batch); types
    # are strict, so "-100" is one too.
    for asked in ("high", None, "-100"):
        body = {"model": MODEL, "prompt": "hi", "priority": asked}
        status, error = await service._call("/v1/completions", body)
        assert (status, error["error"]["param"]) == (400, "priority")
    assert len(seen) == 4
