"""Routing keys travel end to end: the real preprocessor hashes the prompt's blocks once and
the serving core puts them, with the session key, on every engine request (no Ray)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from serve_app.config import AppConfig
from serve_app.hops import EngineChunk, EngineRequest, EngineStep, PreprocessRequest, SamplingSpec
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
    a, b = preprocessor.preprocess_many([chat(config, q) for q in questions])
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
    [result] = plain.preprocess_many([chat(config, "Hi")])
    assert result.prompts[0].block_hashes == ()


async def test_engine_requests_carry_hashes_and_the_session_key(
    preprocessor: Preprocessor,
) -> None:
    sent: list[EngineRequest] = []

    async def preprocess(request: PreprocessRequest):  # type: ignore[no-untyped-def]
        return preprocessor.preprocess_many([request])[0]

    async def generate(request: EngineRequest) -> AsyncIterator[EngineStep]:
        sent.append(request)
        chunk = EngineChunk(index=0, text="x", token_ids=[1], finish_reason="length")
        yield EngineStep([chunk], prompt_tokens=len(request.prompt_token_ids), finished=True)

    serving = OpenAIServing(AppConfig(), preprocess, generate)  # type: ignore[arg-type]
    body = CompletionRequest.model_validate(
        {"model": "smollm2-135m-instruct", "prompt": [SYSTEM, SYSTEM + "Hi"], "max_tokens": 1}
    )
    stats = RequestStats("/v1/completions", "m", session_key="conversation-7")
    await completions.completion(serving, body, stats)
    assert len(sent) == 2 and all(r.session_key == "conversation-7" for r in sent)
    assert all(r.block_hashes == block_hashes(r.prompt_token_ids, 64) for r in sent)
    assert sent[0].block_hashes[:5] == sent[1].block_hashes[:5]
