"""One served model as a router replica sees it: its preprocessor and engine handles, the serving
core over them, its readiness and its context length. A multi-model app has one per model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.errors import BACKEND_UNAVAILABLE, APIError, model_not_found
from serve_app.hops import EngineRequest, LoraAdapter, PreprocessRequest, PreprocessResult
from serve_app.ingress.handles import RESUBMIT_ASSIGN_S, bounded_stream, resubmitted_once
from serve_app.ingress.readiness import Readiness, engine_running
from serve_app.openai.serving import OpenAIServing

READINESS_TTL_S = 2.0  # How long /health answers from its last look at the controller.


class ModelBackend:
    def __init__(
        self,
        config: AppConfig,
        preprocessor: DeploymentHandle,
        engine: DeploymentHandle,
        *,
        app_name: str,
        on_resubmit: Callable[[str], None],
    ) -> None:
        """``config``: this model's single-model config; ``on_resubmit(model)`` counts an
        engine call resubmitted because its replica went away before the first token."""
        self.config = config
        self.preprocessor = preprocessor
        self._engine = engine.options(stream=True)
        engine_name = str(getattr(engine, "deployment_name", "") or "Engine")
        self.readiness = Readiness(
            lambda: engine_running(app_name, engine_name),
            ttl_s=READINESS_TTL_S,
            timeout_s=config.health_timeout_s,
        )
        self._on_resubmit = on_resubmit
        self._max_model_len: int | None = None
        self._preprocessing = 0  # Preprocess calls in flight from this replica.
        self.serving = OpenAIServing(config, preprocess=self._preprocess, generate=self._generate)
        # Every name this backend serves: the model's and its LoRA adapters'.
        self.servings = {self.serving.model_name: self.serving} | {
            name: self.serving.for_adapter(LoraAdapter(name, path))
            for name, path in config.model.lora_adapters.items()
        }

    @property
    def name(self) -> str:
        return self.serving.model_name

    def _generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        """One engine call, bounded; resubmitted once if its engine goes before a token."""
        wait_s = self.config.engine_wait_timeout_s
        return resubmitted_once(
            lambda again: bounded_stream(
                lambda: self._engine.generate.remote(request),
                assign_timeout_s=min(wait_s, RESUBMIT_ASSIGN_S) if again else wait_s,
                timeout_s=self.config.request_timeout_s,
            ),
            on_resubmit=lambda: self._on_resubmit(self.name),
        )

    async def _preprocess(self, request: PreprocessRequest) -> PreprocessResult:
        # The aggregation window (@serve.batch) only pays off when other requests can join it.
        alone = self._preprocessing == 0
        self._preprocessing += 1
        try:
            method = self.preprocessor.preprocess_now if alone else self.preprocessor.preprocess
            return await method.remote(request)
        finally:
            self._preprocessing -= 1

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            self._max_model_len = await self.bounded(self.preprocessor.max_model_len.remote())
        return self._max_model_len

    async def bounded(self, call: Awaitable[Any]) -> Any:
        """A short handle call (model length, tokenize), bounded like an engine assignment."""
        try:
            return await asyncio.wait_for(call, self.config.engine_wait_timeout_s)
        except TimeoutError:
            raise APIError.from_info(BACKEND_UNAVAILABLE) from None


class ModelBackends:
    """The models a router serves, by the name clients put in ``model``."""

    def __init__(self, backends: list[ModelBackend]) -> None:
        self._backends = backends
        self._by_name = {name: b for b in backends for name in b.servings}

    def get(self, model: str) -> ModelBackend:
        """The backend serving ``model``; else 404 naming the served ones."""
        backend = self._by_name.get(model)
        if backend is None:
            raise model_not_found(model, list(self._by_name))
        return backend

    def __iter__(self) -> Any:
        return iter(self._backends)

    def serving(self, model: str) -> OpenAIServing:
        return self.get(model).servings[model]

    async def ready(self) -> bool:
        """Ready when every model has a running engine replica: a model without one would
        answer only errors, and a load balancer should not send its clients here."""
        verdicts = await asyncio.gather(*(b.readiness.ready() for b in self._backends))
        return all(verdicts)
