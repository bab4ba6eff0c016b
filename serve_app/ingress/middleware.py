"""Pure ASGI guard in front of the routes: header size, API key, body size, rate limit.

Pure ASGI (not BaseHTTPMiddleware) so responses, SSE included, pass through untouched. Serve
freezes a copy of the FastAPI app at import time, so settings cannot travel as middleware
arguments: ``Router.__init__`` calls :func:`configure`, which sets this module's state in the
replica process, and the middleware reads it per request.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.config.security import SecurityConfig
from serve_app.errors import ErrorInfo
from serve_app.ingress.keys import KeyRing, load_keys
from serve_app.ingress.ratelimit import (
    LimiterUnavailable,
    RateLimitBackend,
    RayRateLimiter,
    TokenBucket,
)
from serve_app.ingress.request_body import (
    header,
    read_body,
    replay_body,
    send_error,
    stream_within,
)
from serve_app.openai.charging import charge_of_body

logger = logging.getLogger("serve_app.security")

# Everything else needs a key when keys are configured (default deny, not just /v1/*).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
# Uploads: streamed to the route (which spools them to disk), under their own limit.
UPLOAD_PATHS = frozenset({"/v1/files"})
LIMITER_NAME = "serve_app_rate_limiter"


@dataclass
class SecurityState:
    config: SecurityConfig
    keys: KeyRing
    limiter: RateLimitBackend | None = None
    open_paths: TokenBucket | None = None  # /health and the docs: a local budget, no key.
    max_upload_bytes: int = 200 * 1024 * 1024  # POST to UPLOAD_PATHS (batch_api.max_file_bytes).

    def __post_init__(self) -> None:
        if self.open_paths is None:
            self.open_paths = TokenBucket(self.config.open_paths_per_second)


_state: SecurityState | None = None


def configure(
    config: SecurityConfig,
    *,
    app_name: str,
    environ: Mapping[str, str] | None = None,
    max_upload_bytes: int | None = None,
) -> SecurityState:
    """Load keys and pick the limiter for this replica; raises ValueError on bad key sources."""
    global _state
    limiter = RayRateLimiter(f"{LIMITER_NAME}.{app_name}") if config.rate_limited else None
    _state = SecurityState(config, load_keys(config, os.environ if environ is None else environ))
    _state.limiter = limiter
    if max_upload_bytes is not None:
        _state.max_upload_bytes = max_upload_bytes
    return _state


def current() -> SecurityState | None:
    return _state


def route_path(scope: Scope) -> str:
    """The path the router matches: Starlette's own rule for stripping root_path."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        if path == root:
            return ""
        if path[len(root)] == "/":
            return path[len(root) :]
    return path


def _bearer(scope: Scope) -> bytes | None:
    value = header(scope, b"authorization") or b""
    scheme, _, token = value.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, state: SecurityState | None = None) -> None:
        self.app = app
        self._state = state  # Fixed state for tests; otherwise the one `configure` set.

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = self._state or _state
        if state is None:  # Serve routes traffic only after __init__; never expected.
            info = ErrorInfo("Server starting.", status=503, type="server_error", code="starting")
            await send_error(send, info)
            return
        error, name = self._admit(scope, state)
        if error is None and route_path(scope) in OPEN_PATHS:
            error = _open_path_budget(state)
        if error is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                extra = {401: [(b"www-authenticate", b"Bearer")], 429: [(b"retry-after", b"1")]}
                await send_error(send, error, extra.get(error.status, []))
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        if name is not None:
            scope.setdefault("state", {})["api_key_name"] = name
        path = route_path(scope)
        limited = state.limiter is not None and path not in OPEN_PATHS
        if scope.get("method") == "POST" and path in UPLOAD_PATHS:
            # Charged as a request (an upload spends no engine tokens), never buffered here.
            if limited and not await self._charge(scope, send, state, name or "anonymous", b""):
                return
            await stream_within(self.app, scope, receive, send, state.max_upload_bytes)
            return
        body = await read_body(scope, receive, send, state.config.max_body_bytes)
        if body is None:
            return
        if limited and not await self._charge(scope, send, state, name or "anonymous", body):
            return
        await self.app(scope, replay_body(body, receive), send)

    @staticmethod
    def _admit(scope: Scope, state: SecurityState) -> tuple[ErrorInfo | None, str | None]:
        """Header size, then the key; returns (error, key name)."""
        config = state.config
        size = sum(len(key) + len(value) for key, value in scope["headers"])
        if size > config.max_header_bytes:
            message = f"Request headers too large: {size} bytes, limit {config.max_header_bytes}."
            return ErrorInfo(message, status=431, code="request_header_fields_too_large"), None
        if not state.keys or route_path(scope) in OPEN_PATHS:
            return None, None
        presented = _bearer(scope)
        name = state.keys.match(presented) if presented is not None else None
        if name is None:
            client = (scope.get("client") or ("?",))[0]
            reason = "missing" if presented is None else "invalid"
            logger.warning("Rejected %s API key from %s for %s", reason, client, scope["path"])
            message = (
                "Missing API key: send it as `Authorization: Bearer <key>`."
                if presented is None
                else "Incorrect API key provided."
            )
            return ErrorInfo(message, status=401, code="invalid_api_key"), None
        return None, name

    @staticmethod
    async def _charge(
        scope: Scope, send: Send, state: SecurityState, name: str, body: bytes
    ) -> bool:
        config = state.config
        limit = config.rate_limit_for(name)
        tokens = 0
        if limit.tokens_per_minute is not None:
            tokens = charge_of_body(route_path(scope), body, config.unset_max_tokens_charge)
        assert state.limiter is not None
        try:
            decision = await state.limiter.acquire(name, tokens, limit)
        except LimiterUnavailable:
            logger.exception("Rate limiter unavailable; rejecting (fail closed)")
            info = ErrorInfo(
                "Rate limiter unavailable; retry shortly.",
                status=503,
                type="server_error",
                code="rate_limiter_unavailable",
            )
            await send_error(send, info)
            return False
        if decision.allowed:
            return True
        logger.info("Rate limited key %r (%s)", name, decision.reason)
        if decision.reason == "too_large":
            message = (
                f"Request too large for key `{name}`: it needs {tokens} tokens, more than its "
                f"{limit.tokens_per_minute} tokens per minute; lower max_tokens or the prompt."
            )
            await send_error(send, _rate_error(message, "tokens"))
            return False
        retry = max(1, math.ceil(decision.retry_after_s))
        per_minute = (
            f"{limit.requests_per_minute} requests"
            if decision.reason == "requests"
            else f"{limit.tokens_per_minute} tokens"
        )
        message = (
            f"Rate limit reached for key `{name}`: {per_minute} per minute. Retry in {retry} s."
        )
        await send_error(
            send, _rate_error(message, decision.reason), [(b"retry-after", str(retry).encode())]
        )
        return False


def _open_path_budget(state: SecurityState) -> ErrorInfo | None:
    assert state.open_paths is not None
    wait = state.open_paths.take()
    if not wait:
        return None
    rate = state.config.open_paths_per_second
    message = f"Rate limit reached: {rate:g} requests per second on this path. Retry in 1 s."
    return _rate_error(message, "requests")


def _rate_error(message: str, kind: str) -> ErrorInfo:
    # OpenAI's 429 body names what ran out as its type ("requests" or "tokens").
    return ErrorInfo(message, status=429, type=kind, code="rate_limit_exceeded")
