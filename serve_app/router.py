"""The ingress: OpenAI routes over HTTP (FastAPI), errors in OpenAI's shape, SSE streams."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app import chat, completions
from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from serve_app.serving import OpenAIServing

logger = logging.getLogger("serve_app.router")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503, 504)
}
app = FastAPI(
    title="serve_app", summary="OpenAI-compatible API on Ray Serve + vLLM", version="0.1.0"
)


def error_response(info: ErrorInfo) -> JSONResponse:
    return JSONResponse(info.body(), status_code=info.status)


_PARAM_PREFIX = re.compile(r"^(?:Value error, )?([a-z_]+(?:\.[a-z_]+)*): ")


def _param_of(error: dict[str, Any]) -> str | None:
    """Dotted field path of a validation error (messages[0].role), minus pydantic's type tags."""
    path = ""
    for part in error.get("loc", ())[1:]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    if path:
        return path
    match = _PARAM_PREFIX.match(str(error.get("msg", "")))
    return match.group(1) if match else None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function"}


@app.exception_handler(RequestValidationError)
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


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.info)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    from ray.exceptions import RayError

    if isinstance(exc, RayError):  # A replica died or is restarting: retryable.
        logger.warning("Backend unavailable: %s", exc)
        return error_response(
            ErrorInfo(
                "The model backend is unavailable; retry shortly.",
                status=503,
                type="server_error",
                code="backend_unavailable",
            )
        )
    logger.exception("Unexpected error")
    return error_response(
        ErrorInfo(
            f"Internal error: {type(exc).__name__}",
            status=500,
            type="server_error",
            code="internal_error",
        )
    )


def _respond(result: BaseModel | AsyncIterator[str]) -> Any:
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    return StreamingResponse(result, media_type="text/event-stream")


@serve.deployment(name="Router")
@serve.ingress(app)
class Router:
    def __init__(
        self, preprocessor: DeploymentHandle, engine: DeploymentHandle, config: dict[str, Any]
    ) -> None:
        self.config = AppConfig.model_validate(config)
        self._preprocessor = preprocessor
        self._engine = engine.options(stream=True)
        self._max_model_len: int | None = None
        self.serving = OpenAIServing(
            self.config,
            preprocess=lambda request: preprocessor.preprocess.remote(request),
            generate=lambda request: self._engine.generate.remote(request),  # type: ignore[arg-type,return-value]
        )

    async def _with_timeout(self, work: Any) -> Any:
        try:
            return await asyncio.wait_for(work, self.config.request_timeout_s)
        except TimeoutError as exc:
            raise APIError(
                f"The request took longer than {self.config.request_timeout_s:g} s and was "
                "aborted; lower max_tokens or raise request_timeout_s.",
                status=504,
                type="server_error",
                code="timeout",
            ) from exc

    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        if self._max_model_len is None:
            self._max_model_len = await self._preprocessor.max_model_len.remote()
        return self.serving.models(self._max_model_len)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(self, body: ChatCompletionRequest) -> Any:
        return _respond(await self._with_timeout(chat.chat_completion(self.serving, body)))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(self, body: CompletionRequest) -> Any:
        return _respond(await self._with_timeout(completions.completion(self.serving, body)))
