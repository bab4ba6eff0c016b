"""Every failure the ingress can meet, answered in OpenAI's error shape with the right status.

``install`` registers the handlers on the FastAPI app: request validation (400 with the
offending ``param``), unknown routes and methods, ``APIError``, and anything unexpected (a Ray or
Serve failure becomes a retryable 503, the rest a 500 without internals).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.errors import APIError, ErrorInfo, backend_error

logger = logging.getLogger("serve_app.router")


def error_response(info: ErrorInfo) -> JSONResponse:
    response = JSONResponse(info.body(), status_code=info.status)
    if info.status in (429, 503):  # Overloaded or restarting: tell clients when to retry.
        response.headers["retry-after"] = "1"
    elif info.status == 500:  # A bug: the same request fails again (the openai SDK obeys this).
        response.headers["x-should-retry"] = "false"
    return response


_PARAM_PREFIX = re.compile(r"^(?:Value error, )?([a-z_]+(?:\.[a-z_]+)*): ")


def _param_of(error: dict[str, Any]) -> str | None:
    """Dotted field path of a validation error (messages[0].role), minus pydantic's type tags."""
    path = ""
    for part in error.get("loc", ())[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[a-z_][A-Za-z0-9_]*", part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    if path:
        return path
    match = _PARAM_PREFIX.match(str(error.get("msg", "")))
    return match.group(1) if match else None


# Union members pydantic puts in `loc`; model class names are skipped by their capital letter.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(
            ErrorInfo(f"Invalid JSON body: {first.get('msg')}", code="invalid_json")
        )
    param = _param_of(first)
    message = _PARAM_PREFIX.sub("", str(first.get("msg", "invalid request")))
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return error_response(ErrorInfo(message, param=param, code="invalid_value"))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes, wrong methods, unreadable bodies: OpenAI's error shape too."""
    codes = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}
    message = str(exc.detail) if exc.status_code != 404 else "Unknown route; see /openapi.json."
    info = ErrorInfo(message, status=exc.status_code, code=codes.get(exc.status_code))
    response = error_response(info)
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.info)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    info = backend_error(exc)
    if info is not None:  # A replica died, is restarting or is full: retryable.
        logger.warning("Backend unavailable: %r", exc)
        return error_response(info)  # With retry-after, as every 503.
    logger.exception("Unexpected error")
    return error_response(
        ErrorInfo(
            f"Internal error: {type(exc).__name__}",
            status=500,
            type="server_error",
            code="internal_error",
        )
    )


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    # Ray/Serve failures get handlers of their own: Starlette re-raises what reaches the
    # catch-all `Exception` handler, and Serve's proxy then answers a BackPressureError in
    # plain text.
    for failure in (RayError, RayServeException, Exception):
        app.add_exception_handler(failure, _unexpected)
