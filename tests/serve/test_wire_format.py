"""Every body the serve tier sends, parsed by the openai SDK's own pydantic types in strict mode.

Strict: no coercion (a string where an int belongs fails), every required field present (a chunk
without ``"object"`` fails), and no field the type does not declare anywhere in the tree (the
SDK's models allow extras; strict clients do not). The SDK's ``Completion`` requires a
``finish_reason`` on every choice, which OpenAI itself sends as null mid-stream: streamed
completion chunks are checked against a copy that allows null there, nothing else relaxed.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import pytest
from openai import BaseModel as SDKModel
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.serve.conftest import MODEL

# vLLM's additions to a model card, which clients written for `vllm serve` read.
MODEL_EXTRAS = {"root", "max_model_len", "parent"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NAMED_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


class StreamedCompletionChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class StreamedCompletion(Completion):
    choices: list[StreamedCompletionChoice]  # type: ignore[assignment]


def no_extras(value: Any, where: str = "$", allowed: frozenset[str] = frozenset()) -> None:
    """Fail on any field, at any depth, that the SDK type does not declare."""
    if isinstance(value, SDKModel):
        extra = set(value.model_extra or {}) - allowed
        assert not extra, f"{where}: fields the openai types do not declare: {sorted(extra)}"
        for name in type(value).model_fields:
            no_extras(getattr(value, name), f"{where}.{name}", allowed)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_extras(item, f"{where}[{i}]", allowed)


def strict(kind: type[SDKModel], data: Any) -> SDKModel:
    parsed = kind.model_validate(data, strict=True)
    no_extras(parsed)
    return parsed


def stream(base_url: str, route: str, body: dict[str, Any]) -> list[Any]:
    """The JSON payloads of one SSE response, [DONE] checked and dropped."""
    with httpx.stream(
        "POST", f"{base_url}{route}", json=body | {"stream": True}, timeout=300
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def post(base_url: str, route: str, body: dict[str, Any]) -> Any:
    response = httpx.post(f"{base_url}{route}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


CHAT_STREAMS = {
    "plain_with_usage": {"stream_options": {"include_usage": True}},
    "n2_logprobs": {"n": 2, "logprobs": True, "top_logprobs": 2, "temperature": 0.8},
    "named_tool": {"tools": [WEATHER_TOOL], "tool_choice": NAMED_CHOICE},
    "required_tool": {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 40},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "answer",
                "schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    },
}


@pytest.mark.parametrize("extra", CHAT_STREAMS.values(), ids=CHAT_STREAMS.keys())
def test_chat_stream_chunks_are_sdk_chunks(base_url: str, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0} | extra
    chunks = [
        strict(ChatCompletionChunk, chunk)
        for chunk in stream(base_url, "/v1/chat/completions", body)
    ]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    finished = [choice for c in chunks for choice in c.choices if choice.finish_reason]
    assert len(finished) == body.get("n", 1)
    if body.get("stream_options"):
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
    if "tools" in body:
        calls = [
            call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or []
        ]
        assert calls and calls[0].function is not None and calls[0].function.name == "get_weather"


CHAT_FULL = {
    "plain": {},
    "n2_logprobs": {"n": 2, "logprobs": True, "top_logprobs": 2, "temperature": 0.8},
    "named_tool": {"tools": [WEATHER_TOOL], "tool_choice": NAMED_CHOICE},
}


@pytest.mark.parametrize("extra", CHAT_FULL.values(), ids=CHAT_FULL.keys())
def test_chat_responses_are_sdk_responses(base_url: str, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0} | extra
    response = strict(ChatCompletion, post(base_url, "/v1/chat/completions", body))
    assert isinstance(response, ChatCompletion)
    assert response.object == "chat.completion" and len(response.choices) == body.get("n", 1)
    if "tools" in body:
        assert response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls"


COMPLETION_BODIES = {
    "echo_logprobs_usage": {"echo": True, "logprobs": 2, "stream_options": {"include_usage": True}},
    "two_prompts_n2": {
        "prompt": ["The capital of France is", "One, two,"],
        "n": 2,
        "temperature": 0.8,
    },
    "token_ids": {"prompt": [504, 3575, 282, 4649, 314]},
}


@pytest.mark.parametrize("extra", COMPLETION_BODIES.values(), ids=COMPLETION_BODIES.keys())
def test_completion_stream_chunks_are_sdk_completions(base_url: str, extra: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
    } | extra
    chunks = [strict(StreamedCompletion, c) for c in stream(base_url, "/v1/completions", body)]
    assert {c.object for c in chunks} == {"text_completion"}
    prompts = (
        len(body["prompt"])
        if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str)
        else 1
    )
    finished = [choice for c in chunks for choice in c.choices if choice.finish_reason]
    assert len(finished) == prompts * body.get("n", 1)


@pytest.mark.parametrize("extra", COMPLETION_BODIES.values(), ids=COMPLETION_BODIES.keys())
def test_completion_responses_are_sdk_completions(base_url: str, extra: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
    } | extra
    body.pop("stream_options", None)
    response = strict(Completion, post(base_url, "/v1/completions", body))
    assert isinstance(response, Completion)
    assert response.object == "text_completion" and response.usage is not None


def test_model_list_holds_sdk_models(base_url: str) -> None:
    listing = httpx.get(f"{base_url}/v1/models", timeout=30).json()
    assert set(listing) == {"object", "data"} and listing["object"] == "list"
    for card in listing["data"]:
        model = Model.model_validate(card, strict=True)
        no_extras(model, allowed=frozenset(MODEL_EXTRAS))
        assert model.id == MODEL and model.object == "model"
