"""Ray Serve adapters: thin deployments over the plain ``Preprocessor`` and ``VLLMEngine``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError

from serve_app import tracing
from serve_app.autoscaling import QUEUE_METRIC
from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.messages import EngineRequest, EngineStep, PreprocessRequest, PreprocessResult
from serve_app.metrics import BatchMetrics

logger = logging.getLogger("serve_app")


def timeout_error(timeout_s: float) -> APIError:
    return APIError(
        f"The request took longer than {timeout_s:g} s and was aborted; lower max_tokens or "
        "raise request_timeout_s.",
        status=504,
        type="server_error",
        code="timeout",
    )


def _overloaded(exc: BackPressureError) -> APIError:
    return APIError(
        f"The model backend is at capacity ({exc.message.rstrip('.')}); retry shortly.",
        status=exc.status_code,
        type="server_error",
        code="overloaded",
    )


async def bounded_stream(
    call: Callable[[], Any], *, assign_timeout_s: float, timeout_s: float
) -> AsyncIterator[Any]:
    """Items of a streaming handle call (``call()`` returns a ``DeploymentResponseGenerator``),
    bounded twice.

    No replica takes the call within ``assign_timeout_s`` (none running, or all full): 503
    ``backend_unavailable``; the handle's queue is full: 503/429 ``overloaded`` (never Serve's
    raw BackPressureError, which its proxy would answer in plain text). The whole stream past
    ``timeout_s``: 504 ``timeout``. Whenever the stream does not run to its end (bound hit,
    consumer gone), the call is cancelled, so the engine aborts the vLLM request.
    """
    deadline = time.monotonic() + timeout_s
    try:
        response = call()
    except BackPressureError as exc:
        raise _overloaded(exc) from None
    done = False
    try:
        # Private Serve API (2.60): resolves once a replica accepted the call.
        assigned = getattr(response, "_fetch_future_result_async", None)
        if assigned is not None:
            try:
                await asyncio.wait_for(assigned(), min(assign_timeout_s, timeout_s))
            except TimeoutError:
                raise APIError(
                    f"No model replica accepted the request within {assign_timeout_s:g} s "
                    "(starting, restarting or overloaded); retry shortly.",
                    status=503,
                    type="server_error",
                    code="backend_unavailable",
                ) from None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(timeout_s)
            try:
                item = await asyncio.wait_for(anext(response), remaining)
            except StopAsyncIteration:
                done = True
                return
            except TimeoutError:
                raise timeout_error(timeout_s) from None
            yield item
    except BackPressureError as exc:
        raise _overloaded(exc) from None
    finally:
        if not done:
            # Serve's cancel() re-raises a failed assignment (e.g. BackPressureError): that
            # must not replace the error already being raised.
            with contextlib.suppress(Exception):
                response.cancel()


@serve.deployment(name="Preprocessor")
class PreprocessorDeployment:
    """CPU-only: chat template + tokenization, batched over a short aggregation window."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.models import resolve_model
        from serve_app.preprocess import Preprocessor

        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.metrics = BatchMetrics()
        self.preprocessor = Preprocessor(self.config, resolve_model(self.config.model.name))
        settings = self.config.preprocessor
        self.preprocess.set_max_batch_size(settings.max_batch_size)  # type: ignore[attr-defined]
        self.preprocess.set_batch_wait_timeout_s(  # type: ignore[attr-defined]
            settings.batch_wait_timeout_s
        )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def preprocess(self, requests: list[PreprocessRequest]) -> list[PreprocessResult]:
        return await self._preprocess(requests)

    async def preprocess_now(self, request: PreprocessRequest) -> PreprocessResult:
        """No aggregation window: the router calls this when nothing else it has in flight
        could join the batch (a lone request would only wait out the window)."""
        return (await self._preprocess([request]))[0]

    async def _preprocess(self, requests: list[PreprocessRequest]) -> list[PreprocessResult]:
        started_ns = time.time_ns()
        self.metrics.record(len(requests), [(started_ns - r.sent_at_ns) / 1e9 for r in requests])
        # Tokenizing a batch takes milliseconds of CPU: keep the replica's event loop free.
        results = await asyncio.to_thread(self.preprocessor.preprocess_batch, requests)
        if tracing.enabled():
            _preprocess_spans(requests, results, started_ns)
        return results

    def max_model_len(self) -> int:
        return self.preprocessor.max_model_len

    def finished_spans(self) -> list[dict[str, Any]]:
        return tracing.finished_spans()

    def tokenize(
        self, request: PreprocessRequest, add_special_tokens: bool | None
    ) -> tuple[list[int], list[str]] | ErrorInfo:
        try:
            ids = self.preprocessor.tokenize(request, add_special_tokens)
            return ids, self.preprocessor.detokenize(ids)[1]
        except APIError as exc:
            return exc.info

    def detokenize(self, token_ids: list[int]) -> str | ErrorInfo:
        try:
            return self.preprocessor.detokenize(token_ids)[0]
        except APIError as exc:
            return exc.info


@serve.deployment(name="Engine")
class EngineDeployment:
    """Owns one vLLM AsyncLLM; streams engine steps back through the handle."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.engine import VLLMEngine
        from serve_app.models import resolve_model

        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.engine = VLLMEngine(self.config, resolve_model(self.config.model.name))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        # Errors travel as values: exceptions crossing Ray lose their OpenAI fields.
        started_ns, first_ns, last = time.time_ns(), 0, None
        try:
            async for step in self.engine.generate(request):
                if not first_ns and any(c.token_ids for c in step.chunks):
                    first_ns = time.time_ns()
                last = step
                yield step
        except APIError as exc:
            yield exc.info
        finally:
            if tracing.enabled() and request.trace_context:
                _engine_spans(request, started_ns, first_ns, last)

    def finished_spans(self) -> list[dict[str, Any]]:
        return tracing.finished_spans()

    def num_unfinished(self) -> int:
        return self.engine.num_unfinished()

    def engine_args(self) -> dict[str, Any]:
        return self.engine.resolved_args

    async def check_health(self) -> None:
        """Serve's periodic probe: raises when vLLM's engine core is dead (replica replaced)."""
        await self.engine.check_health()

    async def healthy(self) -> bool:
        """The router's /health asks this (cheap: no engine step involved)."""
        try:
            await self.engine.check_health()
        except Exception:
            return False
        return True

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue depth (vLLM running + waiting) for ``serve_app.autoscaling.EngineQueuePolicy``."""
        return {QUEUE_METRIC: float(self.engine.num_unfinished())}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _preprocess_spans(
    requests: list[PreprocessRequest], results: list[PreprocessResult], started_ns: int
) -> None:
    """One span per request, from the router's send through the batch window to tokens."""
    end_ns = time.time_ns()
    for request, result in zip(requests, results, strict=True):
        span = tracing.tracer().start_span(
            "preprocess",
            context=tracing.context_of(request.trace_context),
            start_time=request.sent_at_ns or started_ns,
        )
        span.set_attributes(
            {
                "serve_app.batch.size": len(requests),
                "serve_app.batch.wait_ms": round((started_ns - request.sent_at_ns) / 1e6, 3),
                "gen_ai.usage.input_tokens": sum(len(p.token_ids) for p in result.prompts),
                "serve_app.error": result.error.message if result.error else "",
            }
        )
        span.end(end_time=end_ns)


def _engine_spans(
    request: EngineRequest, started_ns: int, first_ns: int, last: EngineStep | None
) -> None:
    """engine.generate with queue / prefill / decode children from vLLM's own timestamps."""
    end_ns = time.time_ns()
    parent = tracing.tracer().start_span(
        "engine.generate",
        context=tracing.context_of(request.trace_context),
        start_time=started_ns,
    )
    parent.set_attributes(
        {
            "gen_ai.request.max_tokens": request.sampling.max_tokens or 0,
            "gen_ai.request.temperature": request.sampling.temperature,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "serve_app.engine.request_id": request.request_id,
            "serve_app.ttft_ms": round((first_ns - started_ns) / 1e6, 3) if first_ns else -1,
        }
    )
    context = tracing.trace.set_span_in_context(parent)
    timings = last.timings if last is not None else None
    if timings is not None:
        queued, scheduled, first, final = (tracing.monotonic_to_ns(t) for t in timings)
        phases = [
            ("engine.queue", queued, scheduled),
            ("engine.prefill", scheduled, first),
            ("engine.decode", first, final),
        ]
    else:
        phases = [
            ("engine.first_token", started_ns, first_ns or end_ns),
            ("engine.decode", first_ns or end_ns, end_ns),
        ]
    for name, start, end in phases:
        tracing.tracer().start_span(name, context=context, start_time=start).end(end_time=end)
    parent.end(end_time=end_ns)
