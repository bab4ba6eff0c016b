"""Ray Serve adapters: thin deployments over the plain ``Preprocessor`` and ``VLLMEngine``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo
from serve_app.messages import EngineRequest, EngineStep, PreprocessRequest, PreprocessResult

logger = logging.getLogger("serve_app")


@serve.deployment(name="Preprocessor")
class PreprocessorDeployment:
    """CPU-only: chat template + tokenization, batched over a short aggregation window."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.models import resolve_model
        from serve_app.preprocess import Preprocessor

        self.config = AppConfig.model_validate(config)
        self.preprocessor = Preprocessor(self.config, resolve_model(self.config.model.name))
        settings = self.config.preprocessor
        self.preprocess.set_max_batch_size(settings.max_batch_size)  # type: ignore[attr-defined]
        self.preprocess.set_batch_wait_timeout_s(  # type: ignore[attr-defined]
            settings.batch_wait_timeout_s
        )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def preprocess(self, requests: list[PreprocessRequest]) -> list[PreprocessResult]:
        # Tokenizing a batch takes milliseconds of CPU: keep the replica's event loop free.
        return await asyncio.to_thread(self.preprocessor.preprocess_batch, requests)

    def max_model_len(self) -> int:
        return self.preprocessor.max_model_len


@serve.deployment(name="Engine", health_check_period_s=10, health_check_timeout_s=30)
class EngineDeployment:
    """Owns one vLLM AsyncLLM; streams engine steps back through the handle."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.engine import VLLMEngine
        from serve_app.models import resolve_model

        self.config = AppConfig.model_validate(config)
        self.engine = VLLMEngine(self.config, resolve_model(self.config.model.name))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        # Errors travel as values: exceptions crossing Ray lose their OpenAI fields.
        try:
            async for step in self.engine.generate(request):
                yield step
        except APIError as exc:
            yield exc.info

    def engine_args(self) -> dict[str, Any]:
        return self.engine.resolved_args

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
