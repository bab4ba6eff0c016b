"""One served model as a router replica sees it: its preprocessor and engine handles, the serving
core over them, its readiness and its context length. A multi-model app has one per model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.engine.routing.departures import ENGINE_DEPARTURES
from serve_app.errors import BACKEND_UNAVAILABLE, APIError, model_not_found
from serve_app.hops import EngineRequest, LoraAdapter, PreprocessRequest, PreprocessResult
from serve_app.ingress.adapters import GcsStore, RuntimeAdapters
from serve_app.ingress.channels import EngineChannels
from serve_app.ingress.handles import (
    RESUBMIT_ASSIGN_S,
    bounded_stream,
    hop_handle,
    resubmitted_once,
)
from serve_app.ingress.readiness import Readiness, engine_running
from serve_app.openai.serving import OpenAIServing

READINESS_TTL_S = 2.0  # How long /health answers from its last look at the controller.
MAX_CACHED_SERVINGS = 1024  # Serving cores of runtime adapters a router keeps.


class ModelBackend:
    def __init__(
        self,
        config: AppConfig,
        preprocessor: DeploymentHandle,
        engine: DeploymentHandle,
        *,
        app_name: str,
        on_resubmit: Callable[[str], None],
        on_channel_stream: Callable[[str], None] = lambda _: None,
    ) -> None:
        """``config``: this model's single-model config; ``on_resubmit(model)`` counts an
        engine call resubmitted because its replica went away before the first token,
        ``on_channel_stream(model)`` a stream whose steps came through an output channel."""
        self.config = config
        preprocessor = hop_handle(preprocessor, config.serve_throughput_mode)
        engine = hop_handle(engine, config.serve_throughput_mode)
        self.preprocessor = preprocessor
        self.engine = engine  # Unary calls (a runtime adapter's load check).
        self._engine = engine.options(stream=True)
        # Streamed steps through one call per engine replica (serve_app.engine.channels).
        channels = config.engine.output_channels and config.engine.routing.ours()
        self._channels = (
            EngineChannels(self._engine, on_joined=lambda: on_channel_stream(self.name))
            if channels
            else None
        )
        engine_name = str(getattr(engine, "deployment_name", "") or "Engine")
        self.readiness = Readiness(
            lambda: engine_running(app_name, engine_name),
            ttl_s=READINESS_TTL_S,
            timeout_s=config.health_timeout_s,
        )
        self._on_resubmit = on_resubmit
        # Our request router tells a call when its replica is lost (dead or hung).
        self._watch_departures = config.engine.routing.ours()
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
        channels = self._channels if request.stream else None
        return resubmitted_once(
            lambda again: bounded_stream(
                lambda: (
                    channels.call(request) if channels else self._engine.generate.remote(request)
                ),
                assign_timeout_s=min(wait_s, RESUBMIT_ASSIGN_S) if again else wait_s,
                timeout_s=self.config.request_timeout_s,
                watch=(
                    ENGINE_DEPARTURES.watch(request.request_id) if self._watch_departures else None
                ),
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
    """The models a router serves, by the name clients put in ``model``: each model's own, its
    configured adapters' and, with ``runtime``, adapters loaded at runtime."""

    def __init__(
        self, backends: list[ModelBackend], runtime: RuntimeAdapters | None = None
    ) -> None:
        self._backends = backends
        self._by_name = {name: b for b in backends for name in b.servings}
        self._by_model = {b.name: b for b in backends}
        self.runtime = runtime
        self._runtime_servings: dict[LoraAdapter, OpenAIServing] = {}

    @classmethod
    def build(
        cls,
        config: AppConfig,
        handles: dict[str, dict[str, DeploymentHandle]],
        app_name: str,
        on_resubmit: Callable[[str], None] = lambda _: None,
        on_channel_stream: Callable[[str], None] = lambda _: None,
    ) -> ModelBackends:
        """``handles``: per served model name, its ``preprocessor`` and ``engine`` handles;
        runtime adapters shared through Ray's GCS where some model allows them."""
        runtime = None
        if any(c.model.max_runtime_adapters for c in config.per_model()):
            runtime = RuntimeAdapters(GcsStore(), app_name, config.served_names)
        return cls(
            [
                ModelBackend(
                    single,
                    handles[single.model.public_name]["preprocessor"],
                    handles[single.model.public_name]["engine"],
                    app_name=app_name,
                    on_resubmit=on_resubmit,
                    on_channel_stream=on_channel_stream,
                )
                for single in config.per_model()
            ],
            runtime=runtime,
        )

    def get(self, model: str) -> ModelBackend:
        """The backend serving ``model``; else 404 naming the served ones."""
        backend = self._by_name.get(model)
        if backend is not None:
            return backend
        loaded = self.runtime.get(model) if self.runtime else None
        if loaded is None or loaded.model not in self._by_model:
            raise model_not_found(model, self.names())
        return self._by_model[loaded.model]

    def names(self) -> list[str]:
        loaded = [a.name for b in self._backends for a in self._runtime_of(b)]
        return [*self._by_name, *loaded]

    def __iter__(self) -> Any:
        return iter(self._backends)

    def serving(self, model: str) -> OpenAIServing:
        backend = self.get(model)
        if model in backend.servings:
            return backend.servings[model]
        loaded = self.runtime.get(model) if self.runtime else None
        assert loaded is not None  # get() found it.
        return self._runtime_serving(backend, loaded.adapter)

    def servings_of(self, backend: ModelBackend) -> list[OpenAIServing]:
        """Every name ``backend`` serves: its model, its configured and its runtime adapters."""
        loaded = [self._runtime_serving(backend, a) for a in self._runtime_of(backend)]
        return [*backend.servings.values(), *loaded]

    def _runtime_of(self, backend: ModelBackend) -> list[LoraAdapter]:
        return self.runtime.of(backend.name) if self.runtime else []

    def _runtime_serving(self, backend: ModelBackend, adapter: LoraAdapter) -> OpenAIServing:
        serving = self._runtime_servings.get(adapter)
        if serving is None:
            if len(self._runtime_servings) >= MAX_CACHED_SERVINGS:
                self._runtime_servings.clear()  # Unloaded adapters' leftovers; cheap to redo.
            serving = self._runtime_servings[adapter] = backend.serving.for_adapter(adapter)
        return serving

    async def fresh(self) -> None:
        """Bring the runtime adapters up to date (at most one store read per REFRESH_S)."""
        if self.runtime is not None:
            await self.runtime.fresh()

    async def ready(self) -> bool:
        """Ready when every model has a running engine replica: a model without one would
        answer only errors, and a load balancer should not send its clients here."""
        verdicts = await asyncio.gather(*(b.readiness.ready() for b in self._backends))
        return all(verdicts)
