"""One line of a batch, run through the same OpenAI code as the HTTP routes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from pydantic import ValidationError

from serve_app.config import AppConfig
from serve_app.errors import ErrorInfo, backend_error
from serve_app.observability import tracing
from serve_app.openai import chat, completions
from serve_app.openai.limits import check_limits
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.openai.serving import RequestStats, ServingFor

# (batch id, custom_id) of the line the current task runs, set by the batch's runner: its trace.
CURRENT_LINE: ContextVar[tuple[str, str] | None] = ContextVar("batch_line", default=None)


def line_trace_key(batch_id: str, custom_id: str) -> str:
    """What a line's trace id is derived from: one trace per line, whichever process runs it."""
    return f"batch-line\0{batch_id}\0{custom_id}"


async def run_line(
    serving_for: ServingFor,
    config: AppConfig,
    endpoint: str,
    body: dict[str, Any],
    *,
    owner: str,
    priority: int,
    refresh: Callable[[], Awaitable[None]] | None,
) -> tuple[int, dict[str, Any]]:
    """The line's status code and body: a response, or an OpenAI error (never raised)."""
    stats = RequestStats(route=endpoint, model=str(body.get("model")))
    stats.tenant = owner
    span = None
    if tracing.enabled() and (line := CURRENT_LINE.get()) is not None:
        span = tracing.tracer().start_span(
            f"batch line {endpoint}",
            context=tracing.keyed_context(line_trace_key(*line)),
            attributes={"serve_app.batch_id": line[0], "serve_app.custom_id": line[1]},
        )
        stats.trace_context = tracing.inject(span)
    status = 499  # Until it returns: cut short (cancelled, expired, its process stopping).
    try:
        status, result = await _run(serving_for, config, endpoint, body, stats, priority, refresh)
        return status, result
    finally:
        if span is not None:
            span.set_attributes(tracing.request_attributes(stats, status))
            span.end()


async def _run(
    serving_for: ServingFor,
    config: AppConfig,
    endpoint: str,
    body: dict[str, Any],
    stats: RequestStats,
    priority: int,
    refresh: Callable[[], Awaitable[None]] | None,
) -> tuple[int, dict[str, Any]]:
    try:
        work: Any
        if refresh is not None:
            await refresh()
        serving = serving_for(str(body.get("model")))
        if endpoint == "/v1/chat/completions":
            chat_request = ChatCompletionRequest.model_validate(body | {"stream": False})
            check_limits(chat_request, config.security.limits)
            _in_background(chat_request, priority)
            work = chat.chat_completion(serving, chat_request, stats)
        else:
            request = CompletionRequest.model_validate(body | {"stream": False})
            check_limits(request, config.security.limits)
            _in_background(request, priority)
            work = completions.completion(serving, request, stats)
        result = await asyncio.wait_for(work, config.request_timeout_s)
        return 200, result.model_dump(mode="json")
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        info = ErrorInfo(f"{param}: {first.get('msg')}", param=param, code="invalid_value")
    except TimeoutError:
        info = ErrorInfo("The request timed out.", 504, "server_error", code="timeout")
    except Exception as exc:
        info = backend_error(exc) or ErrorInfo(repr(exc), 500, "server_error")
    return info.status, info.body()


def _in_background(request: ChatCompletionRequest | CompletionRequest, priority: int) -> None:
    """Batch lines never run ahead of interactive traffic, whatever priority a line asks.

    Raised after validation, so any value the request model accepts (an int, or a string the
    lax model coerces) is clamped, and one it refuses is that line's 400, not a crash of the
    whole batch.
    """
    request.priority = max(priority, request.priority)
