"""API keys, the ASGI guard, the rate limiter and request limits (no Ray)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Scope

from serve_app.config import AppConfig
from serve_app.config.security import KeyRateLimit, RequestLimits, SecurityConfig
from serve_app.errors import APIError
from serve_app.ingress import keys
from serve_app.ingress.keys import load_keys, parse_keys
from serve_app.ingress.middleware import SecurityMiddleware, SecurityState, route_path
from serve_app.ingress.ratelimit import (
    Decision,
    LimiterUnavailable,
    LocalRateLimiter,
    RayRateLimiter,
    SlidingWindowLimiter,
    TokenBucket,
)
from serve_app.ingress.request_body import DRAIN_MAX_BYTES
from serve_app.openai.limits import check_limits
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-9876543210"
ENV = {"SERVE_APP_API_KEYS": f"alice:{KEY_A}, {KEY_B}"}


# --- key parsing -------------------------------------------------------------------------


def test_env_keys_named_and_bare() -> None:
    ring = load_keys(SecurityConfig(), ENV)
    assert ring.names == ("alice", "env-2")
    assert ring.match(KEY_A.encode()) == "alice"
    assert ring.match(KEY_B.encode()) == "env-2"
    assert ring.match(b"sk-alpha-012345678") is None and ring.match(b"") is None
    assert not load_keys(SecurityConfig(), {})  # No keys: authentication off.


def test_custom_env_var_and_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# team keys\n\nbob:{KEY_A}\n  carol:{KEY_B}  \n")
    path.chmod(0o600)
    config = SecurityConfig(api_keys_env="MY_KEYS", api_keys_file=path)
    ring = load_keys(config, {"MY_KEYS": "dave:sk-dave-00000000", **ENV})
    assert ring.names == ("dave", "bob", "carol")
    assert ring.match(KEY_B.encode()) == "carol"


def test_key_without_valid_name_is_bare() -> None:
    # "a b" is not a key name, so the whole entry is the key (and it has a space: rejected).
    assert parse_keys(["sk:with:colons-123"], "env") == [("sk", "with:colons-123")]
    assert parse_keys(["!bad:sk-0123456789"], "env") == [("env-1", "!bad:sk-0123456789")]


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"SERVE_APP_API_KEYS": "short"}, "8-512 printable ASCII"),
        ({"SERVE_APP_API_KEYS": "x:has space 123"}, "8-512 printable ASCII"),
        ({"SERVE_APP_API_KEYS": f"a:{KEY_A},a:{KEY_B}"}, "duplicate API key names"),
        ({"SERVE_APP_API_KEYS": f"a:{KEY_A},b:{KEY_A}"}, "listed twice"),
    ],
)
def test_bad_keys_fail_without_echoing_the_key(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match) as error:
        load_keys(SecurityConfig(), environ)
    assert KEY_A not in str(error.value) and "has space" not in str(error.value)


def test_missing_file_fails_and_loose_permissions_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="api_keys_file"):
        load_keys(SecurityConfig(api_keys_file=tmp_path / "nope"), {})
    path = tmp_path / "keys"
    path.write_text(f"x:{KEY_A}\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, "serve_app.security"):
        load_keys(SecurityConfig(api_keys_file=path), {})
    assert "chmod 600" in caplog.text and KEY_A not in caplog.text


def test_limits_and_priorities_for_unknown_keys_warn(caplog: pytest.LogCaptureFixture) -> None:
    config = SecurityConfig(key_priorities={"ghost": -5}, key_rate_limits={"alice": {}})
    with caplog.at_level(logging.WARNING, "serve_app.security"):
        load_keys(config, ENV)
    assert "security.key_priorities names unknown key 'ghost'" in caplog.text
    assert "key_rate_limits" not in caplog.text


def test_config_is_bounded_and_strict() -> None:
    with pytest.raises(ValidationError):
        SecurityConfig(api_keys_file=Path("relative/keys"))
    with pytest.raises(ValidationError):
        SecurityConfig.model_validate({"max_body_bytes": 10})
    with pytest.raises(ValidationError):
        SecurityConfig.model_validate({"api_key": "inline keys are not a thing"})
    with pytest.raises(ValidationError):
        SecurityConfig.model_validate({"key_rate_limits": {"bad name": {}}})
    for priorities in ({"bad name": -1}, {"ops": 2**31}, {"ops": -(2**31) - 1}, {"ops": "low"}):
        with pytest.raises(ValidationError):
            SecurityConfig.model_validate({"key_priorities": priorities})
    floors = SecurityConfig(key_priorities={"ops": -10, "nightly": 100})
    assert (floors.min_priority("ops"), floors.min_priority("nightly")) == (-10, 100)
    assert floors.min_priority("alice") == floors.min_priority(None) == 0
    config = AppConfig.model_validate({"security": {"requests_per_minute": 5}}).security
    assert config.rate_limited and config.rate_limit_for("x").requests_per_minute == 5
    assert not SecurityConfig().rate_limited


def test_compare_is_constant_time_over_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", spy)
    ring = load_keys(SecurityConfig(), ENV)
    for presented in (KEY_A, KEY_B, "wrong", "x" * 500):
        calls.clear()
        ring.match(presented.encode())
        # Every key is compared (no early exit), always digest against digest (equal lengths).
        assert calls == [(32, 32), (32, 32)]


# --- the ASGI guard ----------------------------------------------------------------------


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body), "key": request.state._state.get("api_key_name")})


async def _stream(_: Request) -> StreamingResponse:
    async def parts() -> AsyncIterator[str]:
        for i in range(3):
            yield f"data: {i}\n\n"

    return StreamingResponse(parts(), media_type="text/event-stream")


async def _ok(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def _client(
    config: SecurityConfig,
    environ: dict[str, str] | None = None,
    open_paths: TokenBucket | None = None,
) -> httpx.AsyncClient:
    limiter = LocalRateLimiter() if config.rate_limited else None
    keys = load_keys(config, ENV if environ is None else environ)
    state = SecurityState(config, keys, limiter, open_paths)
    routes = [
        Route("/health", _ok),
        Route("/openapi.json", _ok),
        Route("/v1/models", _ok),
        Route("/v1/chat/completions", _echo, methods=["POST"]),
        Route("/v1/completions", _echo, methods=["POST"]),
        Route("/v1/stream", _stream, methods=["POST"]),
        Route("/tokenize", _echo, methods=["POST"]),
    ]
    app = SecurityMiddleware(Starlette(routes=routes), state=state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _assert_error(response: httpx.Response, status: int, code: str, type_: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"], error["param"]) == (code, type_, None)


@pytest.mark.parametrize(
    "headers",
    [{}, _auth("sk-wrong-000000"), {"Authorization": KEY_A}, {"Authorization": f"Basic {KEY_A}"}],
)
async def test_missing_or_wrong_key_is_401(
    headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    async with _client(SecurityConfig()) as client:
        with caplog.at_level(logging.INFO, "serve_app.security"):
            for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]:
                response = await client.request(method, path, headers=headers, json={})
                _assert_error(response, 401, "invalid_api_key", "invalid_request_error")
                assert response.headers["www-authenticate"] == "Bearer"
            # Default deny: routes outside /v1 (the lead's /tokenize, unknown paths) too.
            assert (await client.post("/tokenize", headers=headers)).status_code == 401
            assert (await client.get("/v1/nope", headers=headers)).status_code == 401
    assert "Rejected" in caplog.text and KEY_A not in caplog.text and "sk-wrong" not in caplog.text


async def test_right_key_passes_and_open_paths_need_none() -> None:
    async with _client(SecurityConfig()) as client:
        response = await client.post(
            "/v1/chat/completions", headers=_auth(KEY_A), content=b"12345678"
        )
        assert response.json() == {"bytes": 8, "key": "alice"}
        lower = {"authorization": f"bearer {KEY_B}"}  # The scheme is case-insensitive.
        assert (await client.get("/v1/models", headers=lower)).status_code == 200
        assert (await client.get("/v1/nope", headers=lower)).status_code == 404
        for path in ("/health", "/openapi.json"):
            assert (await client.get(path)).status_code == 200


async def test_open_paths_have_a_local_budget() -> None:
    """/health and the docs need no key, so they get a per-replica budget instead: a flood is
    429 with Retry-After, never a call to the shared limiter (a probe must not fail with it)."""
    stopped_clock = TokenBucket(5, clock=lambda: 0.0)
    async with _client(SecurityConfig(open_paths_per_second=5), open_paths=stopped_clock) as client:
        statuses = [(await client.get("/health")).status_code for _ in range(7)]
        assert statuses == [200] * 5 + [429] * 2
        response = await client.get("/openapi.json")
        _assert_error(response, 429, "rate_limit_exceeded", "requests")
        assert response.headers["retry-after"] == "1"
        # Keyed routes are not charged to it.
        assert (await client.get("/v1/models", headers=_auth(KEY_A))).status_code == 200


def test_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(2, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.5]
    now[0] = 0.5  # Half a second: one request's worth back.
    assert bucket.take() == 0.0 and bucket.take() > 0
    now[0] = 60.0  # Idle: the burst is capped at one second's worth.
    assert [bucket.take() == 0.0 for _ in range(3)] == [True, True, False]


async def test_no_keys_means_open() -> None:
    async with _client(SecurityConfig(), environ={}) as client:
        assert (await client.get("/v1/models")).status_code == 200


async def test_streaming_responses_pass_through() -> None:
    async with (
        _client(SecurityConfig()) as client,
        client.stream("POST", "/v1/stream", headers=_auth(KEY_A)) as response,
    ):
        chunks = [chunk async for chunk in response.aiter_text()]
    assert "".join(chunks) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_big_body_is_413_declared_or_chunked() -> None:
    config = SecurityConfig(max_body_bytes=1024)
    async with _client(config) as client:
        ok = await client.post("/v1/chat/completions", headers=_auth(KEY_A), content=b"x" * 1024)
        assert ok.json()["bytes"] == 1024
        big = await client.post("/v1/chat/completions", headers=_auth(KEY_A), content=b"x" * 1025)
        _assert_error(big, 413, "request_too_large", "invalid_request_error")

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b"y" * 200

        chunked = await client.post("/v1/chat/completions", headers=_auth(KEY_A), content=chunks())
        _assert_error(chunked, 413, "request_too_large", "invalid_request_error")
        assert "content-length" not in chunked.request.headers
        # Unauthenticated clients cannot make the server read a body at all.
        assert (await client.post("/v1/chat/completions", content=b"x" * 2000)).status_code == 401


async def test_big_headers_are_431_even_on_open_paths() -> None:
    async with _client(SecurityConfig(max_header_bytes=1024)) as client:
        response = await client.get("/health", headers={"x-junk": "j" * 1100})
        _assert_error(response, 431, "request_header_fields_too_large", "invalid_request_error")
        assert (await client.get("/health", headers={"x-junk": "j" * 500})).status_code == 200


async def test_rate_limit_is_429_with_retry_after(caplog: pytest.LogCaptureFixture) -> None:
    config = SecurityConfig(requests_per_minute=2, key_rate_limits={"env-2": KeyRateLimit()})
    async with _client(config) as client:
        with caplog.at_level(logging.INFO, "serve_app.security"):
            codes = [
                (await client.get("/v1/models", headers=_auth(KEY_A))).status_code for _ in range(4)
            ]
            limited = await client.get("/v1/models", headers=_auth(KEY_A))
        assert codes == [200, 200, 429, 429]
        _assert_error(limited, 429, "rate_limit_exceeded", "requests")
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        # Another key has its own budget (here: unlimited); open paths are never counted.
        assert (await client.get("/v1/models", headers=_auth(KEY_B))).status_code == 200
        assert (await client.get("/health")).status_code == 200
    assert "'alice'" in caplog.text and KEY_A not in caplog.text


async def test_token_budget_is_charged_up_front() -> None:
    config = SecurityConfig(tokens_per_minute=100)
    body = {"messages": [{"role": "user", "content": "abcd" * 10}], "max_tokens": 25, "n": 2}
    async with _client(config) as client:
        first = await client.post("/v1/chat/completions", headers=_auth(KEY_A), json=body)
        assert first.status_code == 200  # 10 prompt + 2 × 25 = 60 tokens of 100.
        second = await client.post("/v1/chat/completions", headers=_auth(KEY_A), json=body)
        _assert_error(second, 429, "rate_limit_exceeded", "tokens")
        huge = await client.post(
            "/v1/chat/completions", headers=_auth(KEY_B), json={**body, "max_tokens": 500}
        )
        _assert_error(huge, 429, "rate_limit_exceeded", "tokens")
        assert "retry-after" not in huge.headers and "lower max_tokens" in huge.text


async def test_every_prompt_pays_its_own_completion_budget() -> None:
    # 4 prompts × max_tokens 30 = 120 (+ 4 prompt tokens) > 100: too large for any minute.
    # (The old estimate charged the budget once: 4 + 30 = 34, and let it through.)
    config = SecurityConfig(tokens_per_minute=100)
    body = {"prompt": ["a", "b", "c", "d"], "max_tokens": 30}
    async with _client(config) as client:
        response = await client.post("/v1/completions", headers=_auth(KEY_A), json=body)
        _assert_error(response, 429, "rate_limit_exceeded", "tokens")
        assert "it needs 124 tokens" in response.text and "retry-after" not in response.headers
        one = await client.post(
            "/v1/completions", headers=_auth(KEY_A), json={**body, "n": 1, "prompt": "a"}
        )
        assert one.status_code == 200  # 1 + 30.


async def test_tools_are_charged() -> None:
    # 2 prompt tokens + 1 completion token + tools (400 characters of JSON or more: >= 100).
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 400}}]
    body = {"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 1}
    async with _client(SecurityConfig(tokens_per_minute=100)) as client:
        assert (
            await client.post("/v1/chat/completions", headers=_auth(KEY_A), json=body)
        ).status_code == 200
        with_tools = await client.post(
            "/v1/chat/completions", headers=_auth(KEY_B), json={**body, "tools": tools}
        )
        _assert_error(with_tools, 429, "rate_limit_exceeded", "tokens")


async def test_deeply_nested_body_is_not_a_crash_under_a_token_budget() -> None:
    # json.loads raises RecursionError (not ValueError) here: the charge is 0, the route decides.
    deep = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with _client(SecurityConfig(tokens_per_minute=100)) as client:
        response = await client.post("/v1/chat/completions", headers=_auth(KEY_A), content=deep)
        assert response.status_code == 200 and response.json()["bytes"] == len(deep)


async def test_limiter_outage_fails_closed() -> None:
    class Down:
        async def acquire(self, key: str, tokens: int, limit: KeyRateLimit) -> Decision:
            raise LimiterUnavailable("down")

    config = SecurityConfig(requests_per_minute=5)
    state = SecurityState(config, load_keys(config, ENV), Down())
    app = SecurityMiddleware(Starlette(routes=[Route("/v1/models", _ok)]), state=state)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.get("/v1/models", headers=_auth(KEY_A))
    _assert_error(response, 503, "rate_limiter_unavailable", "server_error")


def test_route_path_follows_starlette_root_path_rule() -> None:
    assert route_path({"path": "/secure/v1/models", "root_path": "/secure"}) == "/v1/models"
    assert route_path({"path": "/secure", "root_path": "/secure"}) == ""
    assert route_path({"path": "/securex/health", "root_path": "/secure"}) == "/securex/health"
    assert route_path({"path": "/health", "root_path": ""}) == "/health"


# --- the limiter itself --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sliding_window_requests_exact() -> None:
    clock = Clock()
    limiter = SlidingWindowLimiter(clock)
    assert [limiter.acquire("k", 0, 3, None).allowed for _ in range(3)] == [True] * 3
    clock.now += 20
    denied = limiter.acquire("k", 0, 3, None)
    assert denied == Decision(False, 40.0, "requests")
    assert limiter.acquire("other", 0, 3, None).allowed
    clock.now += 39.9
    assert not limiter.acquire("k", 0, 3, None).allowed
    clock.now += 0.1  # The first three expire together, 60 s after they were admitted.
    assert [limiter.acquire("k", 0, 3, None).allowed for _ in range(4)] == [True] * 3 + [False]
    assert limiter.acquire("k", 0, None, None).allowed  # No limits: never denied.


def test_sliding_window_tokens() -> None:
    clock = Clock()
    limiter = SlidingWindowLimiter(clock)
    assert limiter.acquire("k", 60, None, 100).allowed
    clock.now += 10
    assert limiter.acquire("k", 30, None, 100).allowed
    clock.now += 10
    denied = limiter.acquire("k", 50, None, 100)  # Needs the 60 back: 40 s from now.
    assert denied == Decision(False, 40.0, "tokens")
    assert limiter.acquire("k", 10, None, 100).allowed  # Denials charged nothing.
    assert limiter.acquire("k", 101, None, 100) == Decision(False, 0.0, "too_large")
    clock.now += 40
    assert limiter.acquire("k", 50, None, 100).allowed


async def test_ray_limiter_recreates_a_dead_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.exceptions import RayActorError

    made: list[int] = []

    class Ref:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def __await__(self) -> Any:
            if self.fail:
                raise RayActorError()
            return (yield from _done((True, 0.0, "")))

    class Handle:
        def __init__(self) -> None:
            made.append(1)
            fail = len(made) == 1
            self.acquire = type("M", (), {"remote": staticmethod(lambda *a: Ref(fail))})()

    limiter = RayRateLimiter("test", attempts=2)
    monkeypatch.setattr(limiter, "_handle", lambda: limiter._actor or _set(limiter, Handle()))
    assert (await limiter.acquire("k", 1, KeyRateLimit(requests_per_minute=1))).allowed
    assert len(made) == 2


async def test_ray_limiter_fails_closed_when_its_actor_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stopped (SIGSTOP) limiter actor never answers: 503 after timeout_s, not a hang."""

    async def never() -> Any:
        await asyncio.sleep(3600)

    handle = type(
        "H", (), {"acquire": type("M", (), {"remote": staticmethod(lambda *a: never())})()}
    )()
    limiter = RayRateLimiter("test", timeout_s=0.05)
    monkeypatch.setattr(limiter, "_handle", lambda: handle)
    with pytest.raises(LimiterUnavailable, match="did not answer"):
        await limiter.acquire("k", 1, KeyRateLimit(requests_per_minute=1))


def _set(limiter: RayRateLimiter, handle: Any) -> Any:
    limiter._actor = handle
    return handle


def _done(value: Any) -> Any:
    return value
    yield  # A generator that returns at once: awaitable without an event-loop round trip.


# --- request shape limits --------------------------------------------------------------------

LIMITS = RequestLimits(
    max_tokens_cap=100, max_n=2, max_messages=3, max_tools=1, max_prompt_chars=50, max_prompts=8
)
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT: dict[str, Any] = {"model": "m", "messages": [USER]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({**CHAT, "n": 3}, "n", "integer_above_max_value"),
        ({**CHAT, "max_tokens": 101}, "max_tokens", "integer_above_max_value"),
        (
            {**CHAT, "max_completion_tokens": 101},
            "max_completion_tokens",
            "integer_above_max_value",
        ),
        ({**CHAT, "messages": [USER] * 4}, "messages", "array_above_max_length"),
        ({**CHAT, "tools": [TOOL, TOOL]}, "tools", "array_above_max_length"),
        ({**CHAT, "messages": [{"role": "user", "content": "x" * 51}]}, "messages", None),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 51}]}],
            },
            "messages",
            "string_above_max_length",
        ),
        ({**CHAT, "messages": [{"role": "user", "content": "x" * 26}] * 2}, "messages", None),
        ({**COMPLETION, "n": 3}, "n", "integer_above_max_value"),
        ({**COMPLETION, "max_tokens": 101}, "max_tokens", "integer_above_max_value"),
        ({**COMPLETION, "prompt": "x" * 51}, "prompt", "string_above_max_length"),
        ({**COMPLETION, "prompt": ["x" * 30, "y" * 30]}, "prompt", "string_above_max_length"),
        ({**COMPLETION, "prompt": list(range(51))}, "prompt", "string_above_max_length"),
        ({**COMPLETION, "prompt": ["x"] * 9}, "prompt", "array_above_max_length"),
        ({**COMPLETION, "prompt": [[1]] * 9}, "prompt", "array_above_max_length"),
        ({**COMPLETION, "prompt": ["x"] * 8}, None, None),
        ({**CHAT, "n": 2, "max_tokens": 100, "messages": [USER] * 3, "tools": [TOOL]}, None, None),
        ({**COMPLETION, "prompt": "x" * 50, "max_tokens": 100}, None, None),
        ({**CHAT, "max_tokens": None}, None, None),  # Unset: the context window bounds it.
    ],
)
def test_check_limits(body: dict[str, Any], param: str | None, code: str | None) -> None:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    request = model.model_validate({k: v for k, v in body.items() if v is not None})
    if param is None:
        check_limits(request, LIMITS)
        return
    with pytest.raises(APIError) as error:
        check_limits(request, LIMITS)
    info = error.value.info
    assert (info.status, info.type, info.param) == (400, "invalid_request_error", param)
    assert info.code == (code or "string_above_max_length")
    assert info.message.startswith(f"Invalid '{param}'")


def test_default_limits_allow_what_the_protocol_allows() -> None:
    request = ChatCompletionRequest.model_validate({**CHAT, "n": 16, "max_tokens": 10**6})
    check_limits(request, RequestLimits())


class _Upload:
    """An ASGI receive/send pair that records whether the 413 came before the body was read."""

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        self.left = chunks
        self.chunk = b"z" * chunk_bytes
        self.unread_at_response: int | None = None
        self.status: int | None = None

    async def receive(self) -> Message:
        self.left -= 1
        return {"type": "http.request", "body": self.chunk, "more_body": self.left > 0}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.unread_at_response = self.left


def _scope(headers: list[tuple[bytes, bytes]]) -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {KEY_A}".encode()), *headers],
    }


@pytest.mark.parametrize("declared", [True, False])
async def test_oversized_body_is_read_before_the_413(declared: bool) -> None:
    """Closing with request bytes unread resets the connection and can destroy the 413."""
    upload = _Upload(chunks=40, chunk_bytes=100)
    length = [(b"content-length", b"4000")] if declared else []
    state = SecurityState(SecurityConfig(max_body_bytes=1024), load_keys(SecurityConfig(), ENV))
    middleware = SecurityMiddleware(Starlette(routes=[]), state=state)
    await middleware(_scope(length), upload.receive, upload.send)
    assert (upload.status, upload.unread_at_response) == (413, 0)


async def test_oversized_body_is_not_pulled_when_huge_or_awaiting_continue() -> None:
    config = SecurityConfig(max_body_bytes=1024)
    middleware = SecurityMiddleware(
        Starlette(routes=[]), state=SecurityState(config, load_keys(config, ENV))
    )
    huge = _Upload(chunks=40, chunk_bytes=100)
    await middleware(
        _scope([(b"content-length", b"%d" % (10 * DRAIN_MAX_BYTES))]), huge.receive, huge.send
    )
    assert (huge.status, huge.unread_at_response) == (413, 40)
    waiting = _Upload(chunks=40, chunk_bytes=100)
    headers = [(b"content-length", b"4000"), (b"expect", b"100-continue")]
    await middleware(_scope(headers), waiting.receive, waiting.send)
    assert (waiting.status, waiting.unread_at_response) == (413, 40)


def _upload_app(seen: list[int]) -> Starlette:
    async def upload(request: Request) -> JSONResponse:
        size = 0
        try:
            async for chunk in request.stream():
                seen.append(len(chunk))
                size += len(chunk)
        except Exception:  # The client went away (here: past the limit).
            return JSONResponse({"error": "read failed"}, status_code=400)
        return JSONResponse({"bytes": size})

    return Starlette(routes=[Route("/v1/files", upload, methods=["POST"])])


class _Responses(_Upload):
    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        super().__init__(chunks, chunk_bytes)
        self.starts: list[int] = []

    async def send(self, message: Message) -> None:
        await super().send(message)
        if message["type"] == "http.response.start":
            self.starts.append(message["status"])


async def test_uploads_stream_to_the_route_under_their_own_limit() -> None:
    """POST /v1/files: not buffered by the middleware (the route sees the client's chunks as
    they come), bounded by max_upload_bytes instead of max_body_bytes."""
    config = SecurityConfig(max_body_bytes=1024)
    state = SecurityState(config, load_keys(config, ENV), max_upload_bytes=10_000)
    seen: list[int] = []
    middleware = SecurityMiddleware(_upload_app(seen), state=state)
    scope = _scope([]) | {"path": "/v1/files"}
    fits = _Responses(chunks=50, chunk_bytes=100)  # 5,000 bytes: over max_body_bytes.
    await middleware(scope, fits.receive, fits.send)
    assert fits.starts == [200] and [n for n in seen if n] == [100] * 50
    over = _Responses(chunks=200, chunk_bytes=100)  # 20,000 bytes, no Content-Length.
    await middleware(scope, over.receive, over.send)
    assert over.starts == [413] and over.unread_at_response == 0  # The route's 400 dropped.
    declared = _Responses(chunks=200, chunk_bytes=100)
    scope = _scope([(b"content-length", b"20000")]) | {"path": "/v1/files"}
    seen.clear()
    await middleware(scope, declared.receive, declared.send)
    assert declared.starts == [413] and seen == []  # Refused before the route ran.
    other = _Responses(chunks=50, chunk_bytes=100)  # Every other route: max_body_bytes.
    await middleware(_scope([]), other.receive, other.send)
    assert other.starts == [413]
