"""Bad input over real HTTP: OpenAI-shaped errors with the right status, type, param and code."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.serve.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
LONG = "word " * 5000  # Far more than the 4096-token window.

# (route, body, status, param, code)
CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    ("chat", {**CHAT, "model": "gpt-nope"}, 404, "model", "model_not_found"),
    ("completions", {**COMPLETION, "model": "gpt-nope"}, 404, "model", "model_not_found"),
    ("chat", {**CHAT, "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    (
        "chat",
        {**CHAT, "max_completion_tokens": 4095, "max_tokens": None},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (
        "chat",
        {**CHAT, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("completions", {**COMPLETION, "prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("completions", {**COMPLETION, "prompt": [1, 2, 10**9]}, 400, "prompt", None),
    ("completions", {**COMPLETION, "prompt": ""}, 400, "prompt", None),
    ("chat", {**CHAT, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("chat", {**CHAT, "temperature": 3}, 400, "temperature", "invalid_value"),
    ("chat", {**CHAT, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("chat", {**CHAT, "n": 0}, 400, "n", "invalid_value"),
    ("chat", {**CHAT, "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("chat", {**CHAT, "messages": []}, 400, "messages", "invalid_value"),
    (
        "chat",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    ("chat", {**CHAT, "messages": "hello"}, 400, "messages", "invalid_value"),
    ("chat", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs", "invalid_value"),
    (
        "chat",
        {**CHAT, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    ("chat", {"messages": USER}, 400, "model", "invalid_value"),
    ("completions", {"model": MODEL}, 400, "prompt", "invalid_value"),
    ("completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs", "invalid_value"),
    ("completions", {**COMPLETION, "prompt": [-5]}, 400, "prompt", "invalid_value"),
    ("completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value"),
    ("chat", [CHAT], 400, None, "invalid_value"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "code"), CASES)
def test_bad_request_gets_openai_error(
    base_url: str, route: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"model": "x", "messages": [}'])
def test_malformed_json_is_400(base_url: str, raw: bytes) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-nope", messages=USER)  # type: ignore[arg-type]
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10_000)
    assert too_long.value.code == "context_length_exceeded"


def test_streaming_request_errors_before_the_stream_starts(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=10_000,
            stream=True,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_bug_in_a_replica_is_a_500_the_sdk_does_not_retry(base_url: str, stream: bool) -> None:
    """A RuntimeError raised inside the engine replica (engine.inject_faults, on in the test
    app) is our bug, not an outage: 500 internal_error without Retry-After, x-should-retry:
    false, and the openai SDK (retries on) raises InternalServerError after one attempt."""
    fault = {"x-session-id": "serve_app:fault"}  # The session key the hook answers to.
    body = {**CHAT, "stream": stream}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=fault, timeout=60)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error", error
    assert "retry-after" not in response.headers
    assert response.headers["x-should-retry"] == "false"
    attempts: list[httpx.Request] = []
    sdk = OpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=2,
        http_client=httpx.Client(timeout=60, event_hooks={"request": [attempts.append]}),
    )
    with pytest.raises(openai.InternalServerError):
        sdk.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, stream=stream, extra_headers=fault
        )
    assert len(attempts) == 1
    ok = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=60)
    assert ok.status_code == 200  # The replica lives on.
