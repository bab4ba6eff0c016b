"""The Preprocessor deployment: the plain ``Preprocessor`` behind Serve's aggregation window."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import PreprocessRequest, PreprocessResult
from serve_app.observability import tracing
from serve_app.observability.metrics import WindowMetrics


@serve.deployment(name="Preprocessor")
class PreprocessorDeployment:
    """CPU-only: chat template + tokenization of every request in a short aggregation window."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.models import resolve_model
        from serve_app.preprocess.preprocessor import Preprocessor

        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.metrics = WindowMetrics()
        self.preprocessor = Preprocessor(self.config, resolve_model(self.config.model.name))
        # The aggregation window: Serve's @serve.batch, sized from the config at start.
        settings = self.config.preprocessor
        self.preprocess.set_max_batch_size(  # type: ignore[attr-defined]
            settings.aggregation_max_requests
        )
        self.preprocess.set_batch_wait_timeout_s(  # type: ignore[attr-defined]
            settings.aggregation_window_s
        )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def preprocess(self, requests: list[PreprocessRequest]) -> list[PreprocessResult]:
        return await self._preprocess(requests)

    async def preprocess_now(self, request: PreprocessRequest) -> PreprocessResult:
        """No aggregation window: the router calls this when nothing else it has in flight
        could join the window (a lone request would only wait it out)."""
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


def _preprocess_spans(
    requests: list[PreprocessRequest], results: list[PreprocessResult], started_ns: int
) -> None:
    """One span per request, from the router's send through the aggregation window to tokens."""
    end_ns = time.time_ns()
    for request, result in zip(requests, results, strict=True):
        span = tracing.tracer().start_span(
            "preprocess",
            context=tracing.context_of(request.trace_context),
            start_time=request.sent_at_ns or started_ns,
        )
        span.set_attributes(
            {
                "serve_app.aggregation_window.size": len(requests),
                "serve_app.aggregation_window.wait_ms": round(
                    (started_ns - request.sent_at_ns) / 1e6, 3
                ),
                "gen_ai.usage.input_tokens": sum(len(p.token_ids) for p in result.prompts),
                "serve_app.error": result.error.message if result.error else "",
            }
        )
        span.end(end_time=end_ns)
