"""The ingress: OpenAI routes over HTTP (FastAPI), errors in OpenAI's shape, SSE streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.trace import Span, SpanKind
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.batch_api import routes as batch_routes
from serve_app.config import AppConfig, RoutingConfig
from serve_app.errors import BACKEND_UNAVAILABLE, APIError, ErrorInfo
from serve_app.hops import PreprocessRequest, SamplingSpec
from serve_app.ingress import http_errors, lora_admin
from serve_app.ingress.backends import ModelBackends
from serve_app.ingress.handles import timeout_error
from serve_app.ingress.http_errors import error_response
from serve_app.ingress.keepalive import KeepAliveStreamingResponse, answer_later
from serve_app.ingress.middleware import SecurityMiddleware, configure
from serve_app.ingress.tenancy import allowed_priority, tenant_of
from serve_app.observability import tracing
from serve_app.observability.metrics import RouterMetrics
from serve_app.openai import chat, completions
from serve_app.openai.limits import check_limits
from serve_app.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from serve_app.openai.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from serve_app.openai.serving import OpenAIServing, RequestStats

logger = logging.getLogger("serve_app.router")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 431, 500, 503, 504)
}
app = FastAPI(
    title="serve_app", summary="OpenAI-compatible API on Ray Serve + vLLM", version="0.1.0"
)
# Before @serve.ingress freezes a copy of the app; settings arrive later via `configure`.
app.add_middleware(SecurityMiddleware)
app.include_router(batch_routes.router)  # Before @serve.ingress copies the app.
app.include_router(lora_admin.router)
http_errors.install(app)


def session_key(routing: RoutingConfig, headers: Mapping[str, str], user: str | None) -> str | None:
    """The key that keeps a conversation on one engine replica, if the client sent one."""
    key = headers.get(routing.session_header) if routing.session_header else None
    if not key and routing.session_from_user:
        key = user
    return key[:256] if key else None  # Only hashed: a longer key adds nothing.


@serve.deployment(name="Router")
@serve.ingress(app)
class Router:
    def __init__(
        self,
        backends: dict[str, dict[str, DeploymentHandle]],
        batch_coordinator: DeploymentHandle | None,
        config: dict[str, Any],
    ) -> None:
        """``backends``: per served model name, its ``preprocessor`` and ``engine`` handles;
        ``batch_coordinator``: where /v1/files and /v1/batches are forwarded (None: the
        Batch API is turned off)."""
        self.config = AppConfig.model_validate(config)
        app_name = serve.get_replica_context().app_name
        configure(
            self.config.security,
            app_name=app_name,
            max_upload_bytes=self.config.batch_api.max_file_bytes,
        )
        tracing.configure(self.config.tracing.exporter)
        self.metrics = RouterMetrics(app_name)
        self.backends = ModelBackends.build(
            self.config,
            backends,
            app_name,
            on_resubmit=lambda model: self.metrics.resubmissions.inc(1, {"model": model}),
            on_channel_stream=lambda model: self.metrics.channel_streams.inc(1, {"model": model}),
        )
        if batch_coordinator is not None:
            batch_routes.connect(batch_coordinator)
        lora_admin.attach(self.backends, self.config.security)

    async def _with_timeout(self, work: Any) -> Any:
        try:
            return await asyncio.wait_for(work, self.config.request_timeout_s)
        except TimeoutError as exc:
            raise timeout_error(self.config.request_timeout_s) from exc

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(self) -> JSONResponse:
        """Readiness: 200 while Serve runs a healthy engine replica of every model of this app,
        503 when one has none (starting, restarting, dead or hung). Cached state, no engine
        call: a saturated engine is still ready (``serve_app.ingress.readiness``)."""
        if await self.backends.ready():
            return JSONResponse({"status": "ok"})
        return error_response(BACKEND_UNAVAILABLE)

    @app.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        await self.backends.fresh()
        cards = [
            card
            for backend in self.backends
            for serving in self.backends.servings_of(backend)
            for card in serving.models(await backend.max_model_len()).data
        ]
        return ModelList(data=cards)

    def finished_spans(self) -> list[dict[str, Any]]:
        """Spans kept by the in-memory exporter (tests); not an HTTP route."""
        return tracing.finished_spans()

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        await self.backends.fresh()
        serving = self._check(body, request)
        return await self._run(
            "/v1/chat/completions",
            request,
            lambda stats: chat.chat_completion(serving, body, stats),
            serving,
            user=body.user,
            stream=bool(body.stream),
        )

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        await self.backends.fresh()
        serving = self._check(body, request)
        return await self._run(
            "/v1/completions",
            request,
            lambda stats: completions.completion(serving, body, stats),
            serving,
            user=body.user,
            stream=bool(body.stream),
        )

    def _check(
        self, body: ChatCompletionRequest | CompletionRequest, request: Request
    ) -> OpenAIServing:
        """The operator's bounds on a client's request, before any work is spent on it; the
        serving core of the model it names (404 model_not_found naming the served ones)."""
        serving = self.backends.serving(body.model)
        check_limits(body, self.config.security.limits)
        body.priority = allowed_priority(body.priority, tenant_of(request), self.config.security)
        return serving

    async def _run(
        self,
        route: str,
        request: Request,
        work: Callable[[RequestStats], Awaitable[BaseModel | AsyncIterator[str]]],
        serving: OpenAIServing,
        user: str | None = None,
        stream: bool = False,
    ) -> Response:
        """Trace, time and count one generation request; dispatch on the result type."""
        stats = RequestStats(route=route, model=serving.model_name)
        stats.session_key = session_key(self.config.engine.routing, request.headers, user)
        stats.tenant = tenant_of(request)
        span = tracing.tracer().start_span(
            f"POST {route}", context=tracing.extract(request.headers), kind=SpanKind.SERVER
        )
        stats.trace_context = tracing.inject(span)
        answer = asyncio.ensure_future(self._with_timeout(work(stats)))
        keepalive_s = self.config.sse_keepalive_s if stream else None
        try:
            if keepalive_s is not None:
                await asyncio.wait({answer}, timeout=keepalive_s)
        except BaseException:  # The client went away: so does its work.
            answer.cancel()
            raise
        if keepalive_s is not None and not answer.done():
            # Still waiting: headers now, keep-alive comments meanwhile.
            return KeepAliveStreamingResponse(
                self._observed(answer_later(answer), span, stats),
                keepalive_s,
                media_type="text/event-stream",
                headers=self._trace_headers(span),
            )
        try:
            result = await answer
        except APIError as exc:
            self._finish(span, stats, exc.info.status)
            raise
        except BaseException:
            self._finish(span, stats, 500)
            raise
        headers = self._trace_headers(span)
        if isinstance(result, BaseModel):
            self._finish(span, stats, 200)
            return JSONResponse(result.model_dump(mode="json"), headers=headers)
        events = self._observed(result, span, stats)
        if keepalive_s is None:
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return KeepAliveStreamingResponse(
            events, keepalive_s, media_type="text/event-stream", headers=headers
        )

    @staticmethod
    def _trace_headers(span: Span) -> dict[str, str]:
        # Serve already answers with its own x-request-id; the trace id travels in traceparent.
        traceparent = tracing.traceparent(span)
        return {"traceparent": traceparent} if traceparent else {}

    async def _observed(
        self, stream: AsyncIterator[str], span: Span, stats: RequestStats
    ) -> AsyncIterator[str]:
        status = 499  # Until the stream completes: the client went away.
        try:
            async for event in stream:
                yield event
            status = 200
        finally:
            self._finish(span, stats, status)

    def _finish(self, span: Span, stats: RequestStats, status: int) -> None:
        self.metrics.record(stats, status)
        span.set_attributes(tracing.request_attributes(stats, status))
        span.end()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        await self.backends.fresh()
        backend = self.backends.get(body.model)
        request = PreprocessRequest(
            request_id="tokenize",
            kind="completion" if body.prompt is not None else "chat",
            sampling=SamplingSpec(),
            prompts=[body.prompt] if body.prompt is not None else None,
            messages=[m.to_template_dict() for m in body.messages or []],
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
        )
        result = await backend.bounded(
            backend.preprocessor.tokenize.remote(request, body.add_special_tokens)
        )
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        ids, strs = result
        return TokenizeResponse(
            count=len(ids),
            max_model_len=await backend.max_model_len(),
            tokens=ids,
            token_strs=strs if body.return_token_strs else None,
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        await self.backends.fresh()
        backend = self.backends.get(body.model)
        result = await backend.bounded(backend.preprocessor.detokenize.remote(body.tokens))
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        return DetokenizeResponse(prompt=result)
