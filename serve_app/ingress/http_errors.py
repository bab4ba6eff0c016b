"""Every failure the ingress can meet, answered in OpenAI's error shape with the right status.

``install`` registers the handlers on the FastAPI app: request validation (400 with the
offending ``param``), unknown routes and methods, ``APIError``, and anything unexpected, mapped
by cause (``errors.backend_error``): a replica that died or a full queue is a retryable 503/429
with Retry-After, a bug in any replica a 500 ``internal_error`` logged with its traceback.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.errors import APIError, ErrorInfo, logged_error
from serve_app.openai.validation import validation_info

logger = logging.getLogger("serve_app.ingress.router")


def error_response(info: ErrorInfo) -> JSONResponse:
    response = JSONResponse(info.body(), status_code=info.status)
    if info.status in (429, 503):  # Overloaded or restarting: tell clients when to retry.
        retry_after = 1 if info.retry_after_s is None else max(0, math.ceil(info.retry_after_s))
        response.headers["retry-after"] = str(retry_after)
    elif info.status == 500:  # A bug: the openai SDK would otherwise retry it as if busy.
        response.headers["x-should-retry"] = "false"
    return response


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_info(list(exc.errors())))


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
    return error_response(logged_error(exc))


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    # Ray/Serve failures get handlers of their own: Starlette re-raises what reaches the
    # catch-all `Exception` handler, and Serve's proxy then answers a BackPressureError in
    # plain text.
    for failure in (RayError, RayServeException, Exception):
        app.add_exception_handler(failure, _unexpected)
