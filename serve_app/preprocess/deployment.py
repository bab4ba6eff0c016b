"""The Preprocessor deployment: a thin Serve adapter over the plain ``Preprocessor``.

Each request is rendered on its own (chat template, structured-output checks) in a small thread
pool, each under its own time limit, so a slow one holds up no other; requests that arrive within
the aggregation window (Serve's ``@serve.batch``) are then tokenized in one call.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import PreprocessRequest, PreprocessResult
from serve_app.observability import spans, tracing
from serve_app.observability.metrics import WindowMetrics

if TYPE_CHECKING:  # The tokenizer stack is imported by the replica, not by whoever builds the app.
    from serve_app.preprocess.preprocessor import Rendered
_RENDER_THREADS = 4


@serve.deployment(name="Preprocessor")
class PreprocessorDeployment:
    """CPU-only: chat template + tokenization over a short aggregation window."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.models import resolve_model
        from serve_app.preprocess.preprocessor import Preprocessor

        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.metrics = WindowMetrics()
        self.preprocessor = Preprocessor(self.config, resolve_model(self.config.model.name))
        self._renderers = ThreadPoolExecutor(_RENDER_THREADS, thread_name_prefix="render")
        self._held = 0  # Preprocess calls in this replica now.
        settings = self.config.preprocessor
        # The decorator's arguments are placeholders: the window comes from the config.
        self._window.set_max_batch_size(settings.aggregation_max_requests)  # type: ignore[attr-defined]
        self._window.set_batch_wait_timeout_s(settings.aggregation_window_s)  # type: ignore[attr-defined]

    async def preprocess(self, request: PreprocessRequest) -> PreprocessResult:
        """Rendered alone, then tokenized with whatever else arrives within the window; a
        request this replica holds alone skips the window (nothing could join it: it would
        only wait the window out). Decided here, where the window is, from what every caller
        (router replicas, the batch coordinator) has sent this replica."""
        alone = self._held == 0
        self._held += 1
        try:
            rendered = await self._render(request)
            if alone and self._held == 1:
                return (await self._preprocess([(request, rendered)]))[0]
            return await self._window((request, rendered))
        finally:
            self._held -= 1

    async def preprocess_now(self, request: PreprocessRequest) -> PreprocessResult:
        """No aggregation window at all (kept for callers of an earlier version)."""
        return (await self._preprocess([(request, await self._render(request))]))[0]

    async def _render(self, request: PreprocessRequest) -> Rendered | ErrorInfo:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._renderers, self.preprocessor.render, request)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _window(
        self, items: list[tuple[PreprocessRequest, Rendered | ErrorInfo]]
    ) -> list[PreprocessResult]:
        return await self._preprocess(items)

    async def _preprocess(
        self, items: list[tuple[PreprocessRequest, Rendered | ErrorInfo]]
    ) -> list[PreprocessResult]:
        requests = [request for request, _ in items]
        started_ns = time.time_ns()
        self.metrics.record(len(requests), [(started_ns - r.sent_at_ns) / 1e9 for r in requests])
        # Tokenizing a window takes milliseconds of CPU: keep the replica's event loop free.
        results = await asyncio.to_thread(
            self.preprocessor.preprocess_many, requests, [rendered for _, rendered in items]
        )
        if tracing.enabled():
            spans.preprocess_spans(requests, results, started_ns)
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
