"""Routing keys travel end to end: the router reads the session key, the real preprocessor
hashes the prompt's blocks once, and the serving core puts both on every engine request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from starlette.datastructures import Headers

from serve_app.config import AppConfig, RoutingConfig
from serve_app.hops import (
    EngineChunk,
    EngineRequest,
    EngineStep,
    PreprocessRequest,
    PreprocessResult,
    SamplingSpec,
)
from serve_app.ingress.router import session_key
from serve_app.models import resolve_model
from serve_app.openai import completions
from serve_app.openai.protocol import CompletionRequest
from serve_app.openai.serving import OpenAIServing, RequestStats
from serve_app.preprocess.block_hashes import block_hashes
from serve_app.preprocess.preprocessor import Preprocessor

SYSTEM = "You are a careful assistant for a shipping company. " * 40


def chat(config: AppConfig, question: str) -> PreprocessRequest:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return PreprocessRequest("r", "chat", SamplingSpec(), messages=messages)


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor(AppConfig(), resolve_model("smollm2-135m-instruct"))


def test_prompts_sharing_a_system_prompt_share_leading_hashes(preprocessor: Preprocessor) -> None:
    config = AppConfig()
    questions = ["Where is my parcel? " * 20, "When do you open? " * 20]
    a, b = preprocessor.preprocess_batch([chat(config, q) for q in questions])
    pa, pb = a.prompts[0], b.prompts[0]
    size = config.engine.routing.block_size
    assert pa.block_hashes == block_hashes(pa.token_ids, size)
    assert len(pa.block_hashes) == len(pa.token_ids) // size >= 5
    shared = next(
        i for i, (x, y) in enumerate(zip(pa.token_ids, pb.token_ids, strict=False)) if x != y
    )
    assert pa.block_hashes[: shared // size] == pb.block_hashes[: shared // size]
    assert pa.block_hashes[shared // size + 1 :] != pb.block_hashes[shared // size + 1 :]
    assert pa.block_hashes[-1] != pb.block_hashes[-1]


def test_no_hashes_when_the_policy_does_not_read_them() -> None:
    config = AppConfig.model_validate({"engine": {"routing": {"policy": "session"}}})
    plain = Preprocessor(config, resolve_model("smollm2-135m-instruct"))
    [result] = plain.preprocess_batch([chat(config, "Hi")])
    assert result.prompts[0].block_hashes == ()


async def test_engine_requests_carry_hashes_and_the_session_key(
    preprocessor: Preprocessor,
) -> None:
    sent: list[EngineRequest] = []

    async def preprocess(request: PreprocessRequest) -> PreprocessResult:
        return preprocessor.preprocess_batch([request])[0]

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep]:
        sent.append(request)
        chunk = EngineChunk(index=0, text="x", token_ids=[1], finish_reason="length")
        yield EngineStep([chunk], prompt_tokens=len(request.prompt_token_ids), finished=True)

    serving = OpenAIServing(AppConfig(), preprocess, generate)
    body = CompletionRequest.model_validate(
        {"model": "smollm2-135m-instruct", "prompt": [SYSTEM, SYSTEM + "Hi"], "max_tokens": 1}
    )
    stats = RequestStats("/v1/completions", "m", session_key="conversation-7")
    await completions.completion(serving, body, stats)
    assert len(sent) == 2 and all(r.session_key == "conversation-7" for r in sent)
    assert all(r.block_hashes == block_hashes(r.prompt_token_ids, 64) for r in sent)
    assert sent[0].block_hashes[:5] == sent[1].block_hashes[:5]


def test_the_session_key_comes_from_the_header_then_the_user_field() -> None:
    routing = RoutingConfig()
    assert session_key(routing, {"x-session-id": "conv-1"}, "alice") == "conv-1"
    # Request headers as the route gets them: any case.
    assert session_key(routing, Headers({"X-Session-ID": "conv-2"}), None) == "conv-2"
    assert session_key(routing, {}, "alice") is None  # `user` only when asked for.
    by_user = RoutingConfig(session_from_user=True)
    assert session_key(by_user, {"x-session-id": "conv-1"}, "alice") == "conv-1"
    assert session_key(by_user, {"x-session-id": ""}, "alice") == "alice"
    assert session_key(by_user, {}, None) is None and session_key(by_user, {}, "") is None
    custom = RoutingConfig(session_header="X-Conversation", session_from_user=True)
    assert session_key(custom, {"x-conversation": "c"}, "alice") == "c"
    assert session_key(custom, {"x-session-id": "ignored"}, "alice") == "alice"
    no_header = RoutingConfig(session_header=None)
    assert session_key(no_header, {"x-session-id": "ignored"}, None) is None
    assert session_key(routing, {"x-session-id": "k" * 1000}, None) == "k" * 256


def test_a_bug_on_one_request_fails_that_request_only(
    preprocessor: Preprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-APIError raised for one request of an aggregation window (in its template render,
    or in the batched tokenizer call) is that request's 500 internal_error; its neighbours are
    served as usual."""
    render, tokenizer = preprocessor._render, preprocessor.tokenizer

    def broken_render(request: PreprocessRequest) -> object:
        if request.request_id == "bug":
            raise KeyError("a bug")
        return render(request)

    def broken_tokenizer(texts: object, **kwargs: object) -> object:
        if isinstance(texts, list) and any("poison" in text for text in texts):
            raise IndexError("a tokenizer bug")
        return tokenizer(texts, **kwargs)

    monkeypatch.setattr(preprocessor, "_render", broken_render)
    monkeypatch.setattr(preprocessor, "tokenizer", broken_tokenizer)
    requests = [
        chat(AppConfig(), "What is 2 + 2?"),
        PreprocessRequest(
            "bug", "chat", SamplingSpec(), messages=[{"role": "user", "content": "x"}]
        ),
        chat(AppConfig(), "poison"),
        chat(AppConfig(), "Name a colour."),
    ]
    results = preprocessor.preprocess_batch(requests)
    assert [r.error is None for r in results] == [True, False, False, True]
    for failed in (results[1], results[2]):
        assert failed.error is not None
        assert (failed.error.status, failed.error.code) == (500, "internal_error")
    assert all(r.prompts for r in (results[0], results[3]))
