"""The ingress: OpenAI routes over HTTP (FastAPI), errors in OpenAI's shape, SSE streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.trace import Span, SpanKind
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.batch_api import routes as batch_api
from serve_app.config import AppConfig
from serve_app.errors import BACKEND_UNAVAILABLE, APIError, ErrorInfo
from serve_app.graph.handles import timeout_error
from serve_app.graph.model_handles import ModelHandles, adapter_registry, served_models
from serve_app.hops import PreprocessRequest, SamplingSpec
from serve_app.ingress import adapter_routes, http_errors, middleware
from serve_app.ingress.adapter_routes import AdapterAdmin
from serve_app.ingress.http_errors import error_response
from serve_app.ingress.middleware import SecurityMiddleware, configure
from serve_app.ingress.readiness import Readiness, fewest_running
from serve_app.ingress.tenancy import clamp_priority, tenant_of
from serve_app.observability import tracing
from serve_app.observability.metrics import RouterMetrics
from serve_app.openai import chat, completions
from serve_app.openai.limits import check_limits
from serve_app.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
)
from serve_app.openai.protocol.responses import dump
from serve_app.openai.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from serve_app.openai.serving import RequestStats
from serve_app.openai.sse import with_keepalive

logger = logging.getLogger("serve_app.ingress.router")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 431, 500, 503, 504)
}
app = FastAPI(
    title="serve_app", summary="OpenAI-compatible API on Ray Serve + vLLM", version="0.1.0"
)
# Before @serve.ingress freezes a copy of the app; settings arrive later via `configure`.
app.add_middleware(SecurityMiddleware)
app.include_router(batch_api.router)  # Before @serve.ingress copies the app.
app.include_router(adapter_routes.router)
http_errors.install(app)


@serve.deployment(name="Router")
@serve.ingress(app)
class Router:
    def __init__(
        self,
        preprocessor: DeploymentHandle,
        engine: DeploymentHandle,
        config: dict[str, Any],
        *,
        other_models: list[tuple[DeploymentHandle, DeploymentHandle]] | None = None,
        batch_coordinator: DeploymentHandle | None = None,
    ) -> None:
        """``preprocessor``, ``engine``: the first model's; ``other_models``: the
        (preprocessor, engine) handles of the others, in ``config.models`` order."""
        self.config = AppConfig.model_validate(config)
        app_name = serve.get_replica_context().app_name
        wait_s = self.config.engine_wait_timeout_s
        security = configure(self.config.security, app_name=app_name, call_timeout_s=wait_s)
        tracing.configure(self.config.tracing.exporter)
        self.metrics = RouterMetrics()
        self._resubmits = 0
        self.models: dict[str, ModelHandles] = {}
        for i, (pre, eng) in enumerate([(preprocessor, engine), *(other_models or [])]):
            handles = ModelHandles(self.config.for_model(i), pre, eng, self._resubmitted)
            self.models[handles.name] = handles
        registry = adapter_registry(self.config, app_name)
        self.served = served_models(list(self.models.values()), registry)
        self.serving = self.served.primary  # Resolves every model and adapter by name.
        engines = [b.deployment_names(i == 0)[1] for i, b in enumerate(self.config.models)]
        self.readiness = Readiness(
            lambda: fewest_running(app_name, engines),
            timeout_s=self.config.health_timeout_s,
            on_update=self.metrics.ready_engines.set,
        )
        if batch_coordinator is not None:  # /v1/files, /v1/batches: forwarded to it.
            batch_api.connect(batch_coordinator, self.config.batch_api)
            # Uploads stream to the coordinator under their own limit, not the body limit.
            limit = batch_api.upload_body_limit(self.config.batch_api)
            middleware.stream_body("/v1/files", limit)
        admin = None
        if registry is not None:
            loaders = {name: handles.load_adapter for name, handles in self.models.items()}
            admin = AdapterAdmin(self.config, registry, loaders, lambda: bool(security.keys))
        adapter_routes.attach(admin)

    def _resubmitted(self, why: BaseException | ErrorInfo) -> None:
        self._resubmits += 1
        self.metrics.resubmits.inc()

    def fleet_stats(self) -> dict[str, int]:
        """Engine calls this replica re-submitted after losing a replica (tests; not a route)."""
        return {"resubmits": self._resubmits}

    async def _with_timeout(self, work: Any) -> Any:
        try:
            return await asyncio.wait_for(work, self.config.request_timeout_s)
        except TimeoutError as exc:
            raise timeout_error(self.config.request_timeout_s) from exc

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(self) -> JSONResponse:
        """Readiness: 200 while the app has a RUNNING engine replica (one that passes Serve's
        health check: engine core alive and making progress), from cached state; no engine
        call, so a busy engine never makes the app unready (saturation is in the metrics)."""
        if await self.readiness.ready():
            return JSONResponse({"status": "ok"})
        return error_response(BACKEND_UNAVAILABLE)

    @app.get("/livez")
    async def livez(self) -> JSONResponse:
        """Liveness of the ingress: a router replica answers; the engines are not consulted."""
        return JSONResponse({"status": "alive"})

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(self) -> JSONResponse:
        """Every model and LoRA adapter (with its `parent`), with vLLM's max_model_len."""
        lens = await asyncio.gather(*(m.max_model_len() for m in self.models.values()))
        listing = await self.served.model_list(dict(zip(self.models, lens, strict=True)))
        return JSONResponse(dump(listing))

    def finished_spans(self) -> list[dict[str, Any]]:
        """Spans kept by the in-memory exporter (tests); not an HTTP route."""
        return tracing.finished_spans()

    async def _model_of(self, model: str) -> ModelHandles:
        """The deployments serving ``model`` (an adapter's: its base model's)."""
        serving = await self.served.resolve(model)
        return self.models[serving.config.model.public_name]

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        check_limits(body, self.config.security.limits)
        clamp_priority(body, tenant_of(request), self.config.security)
        return await self._run(
            "/v1/chat/completions",
            request,
            lambda stats: chat.chat_completion(self.serving, body, stats),
            user=body.user,
            model=body.model,
        )

    @app.post("/v1/completions", response_model=Completion, responses=_ERRORS)
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        check_limits(body, self.config.security.limits)
        clamp_priority(body, tenant_of(request), self.config.security)
        return await self._run(
            "/v1/completions",
            request,
            lambda stats: completions.completion(self.serving, body, stats),
            user=body.user,
            model=body.model,
        )

    async def _run(
        self,
        route: str,
        request: Request,
        work: Callable[[RequestStats], Awaitable[BaseModel | AsyncIterator[str]]],
        user: str | None = None,
        model: str = "",
    ) -> Response:
        """Trace, time and count one generation request; dispatch on the result type."""
        stats = RequestStats(route=route, model=self.serving.model_name, tenant=tenant_of(request))
        stats.session_key = await self._session_key(request, model, user)
        span = tracing.tracer().start_span(
            f"POST {route}", context=tracing.extract(request.headers), kind=SpanKind.SERVER
        )
        stats.trace_context = tracing.inject(span)
        try:
            result = await self._with_timeout(work(stats))
        except APIError as exc:
            self._finish(span, stats, exc.info.status)
            raise
        except BaseException:
            self._finish(span, stats, 500)
            raise
        # Serve already answers with its own x-request-id; the trace id travels in traceparent.
        headers = {}
        if traceparent := tracing.traceparent(span):
            headers["traceparent"] = traceparent
        if isinstance(result, BaseModel):
            self._finish(span, stats, 200)
            return JSONResponse(dump(result), headers=headers)
        return StreamingResponse(
            self._observed(result, span, stats), media_type="text/event-stream", headers=headers
        )

    async def _session_key(self, request: Request, model: str, user: str | None) -> str | None:
        """The key that keeps a conversation on one engine replica, if the client sent one
        (read as the requested model's routing config says)."""
        routing = self.config.engine.routing
        if len(self.models) > 1:
            try:
                routing = (await self._model_of(model)).config.engine.routing
            except APIError:
                return None  # An unknown model: the route answers 404 itself.
        key = request.headers.get(routing.session_header) if routing.session_header else None
        if not key and routing.session_from_user:
            key = user
        return key[:256] if key else None  # Only hashed: a longer key adds nothing.

    async def _observed(
        self, stream: AsyncIterator[str], span: Span, stats: RequestStats
    ) -> AsyncIterator[str]:
        status = 499  # Until the stream completes: the client went away.
        try:
            async for event in with_keepalive(stream, self.config.sse_keepalive_s):
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
        model = await self._model_of(body.model)
        request = PreprocessRequest(
            request_id="tokenize",
            kind="completion" if body.prompt is not None else "chat",
            sampling=SamplingSpec(),
            prompts=[body.prompt] if body.prompt is not None else None,
            messages=[m.to_template_dict() for m in body.messages or []],
            tools=body.template_tools(),
            add_generation_prompt=body.add_generation_prompt,
        )
        result = await model.bounded(
            model.preprocessor.tokenize.remote(request, body.add_special_tokens)
        )
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        ids, strs = result
        return TokenizeResponse(
            count=len(ids),
            max_model_len=await model.max_model_len(),
            tokens=ids,
            token_strs=strs if body.return_token_strs else None,
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        model = await self._model_of(body.model)
        result = await model.bounded(model.preprocessor.detokenize.remote(body.tokens))
        if isinstance(result, ErrorInfo):
            raise APIError.from_info(result)
        return DetokenizeResponse(prompt=result)
