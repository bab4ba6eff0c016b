"""One model's deployments as a router calls them, and the dispatch over all of them.

``ModelHandles`` wraps a model's Preprocessor and Engine handles (bounded calls, re-submitted
engine streams) into that model's ``OpenAIServing``. ``served_models`` builds the dispatch on
the request's `model` over every model and LoRA adapter: what the Router's routes use, and what
any other caller of the models (the Batch API) should use, so a line naming an adapter or a
second model runs exactly as an HTTP request would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.errors import ErrorInfo
from serve_app.graph import step_inbox
from serve_app.graph.adapter_registry import REGISTRY_NAME, AdapterRegistry, RayTable
from serve_app.graph.handles import bounded_call, resubmitting_stream
from serve_app.hops import AdapterRef, EngineRequest, PreprocessRequest, PreprocessResult
from serve_app.openai.dispatch import ServedModels
from serve_app.openai.serving import OpenAIServing


def transport(handle: DeploymentHandle) -> DeploymentHandle:
    """``handle`` over gRPC when this replica's Serve runs its throughput-optimized data plane.

    A handle keeps the transport of the process that built the graph (the driver, whose
    ray.serve may have been imported before RAY_SERVE_THROUGHPUT_OPTIMIZED was set); the
    replica's own setting is the one Ray was started with."""
    from ray.serve._private import constants

    return handle.options(_by_reference=not constants.RAY_SERVE_USE_GRPC_BY_DEFAULT)


class ModelHandles:
    """The Preprocessor and Engine of one model, behind bounded calls."""

    def __init__(
        self,
        config: AppConfig,
        preprocessor: DeploymentHandle,
        engine: DeploymentHandle,
        on_retry: Callable[[BaseException | ErrorInfo], None] | None = None,
    ) -> None:
        """``config``: this model's view (``AppConfig.for_model``)."""
        self.config, self.name = config, config.model.public_name
        # The engine by reference (Ray's own actor calls) whatever the data plane: only that
        # transport tells a replica that died (its requests are re-submitted) from one that
        # is unreachable and may still run them (Serve's gRPC reports both as unavailable).
        # Tokens ride the step channel, so its cost per message is paid per request.
        self.preprocessor, self.engine = transport(preprocessor), engine.options(_by_reference=True)
        self._stream = self.engine.options(stream=True)
        self._on_retry = on_retry
        self._max_model_len: int | None = None
        self.serving = OpenAIServing(config, preprocess=self.preprocess, generate=self.generate)

    async def preprocess(self, request: PreprocessRequest) -> PreprocessResult:
        # The preprocessor replica decides whether the request waits for the window.
        return await self.bounded(self.preprocessor.preprocess.remote(request))

    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        return resubmitting_stream(
            lambda: self._call_engine(request),
            assign_timeout_s=self.config.engine_wait_timeout_s,
            timeout_s=self.config.request_timeout_s,
            on_retry=self._on_retry,
        )

    def _call_engine(self, request: EngineRequest) -> Any:
        """One attempt: a streaming handle call, its steps over this process's step inbox
        (a fresh key per attempt) unless the model streams through the handle."""
        if not request.stream or self.config.engine.step_transport != "channel":
            return self._stream.generate.remote(request)
        box = step_inbox.inbox()
        key, queue = box.register()
        try:
            routed = replace(request, reply_to=box.address, reply_key=key)
            response = self._stream.generate.remote(routed)
        except BaseException:
            box.unregister(key)
            raise
        return step_inbox.ChanneledResponse(response, box, key, queue)

    async def bounded(self, call: Any, what: str = "The preprocessor") -> Any:
        return await bounded_call(call, self.config.engine_wait_timeout_s, what)

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            self._max_model_len = await self.bounded(self.preprocessor.max_model_len.remote())
        return self._max_model_len

    async def load_adapter(self, adapter: AdapterRef) -> ErrorInfo | None:
        """Load ``adapter`` into the engine replica its requests will be routed to (its
        routing block goes with the call); the time to fetch it is bounded by
        request_timeout_s, a hub download included."""
        call = self.engine.load_adapter.remote(adapter)
        result: ErrorInfo | None = await bounded_call(
            call, self.config.request_timeout_s, "The engine"
        )
        return result


def adapter_registry(config: AppConfig, app_name: str) -> AdapterRegistry | None:
    """The app's shared adapter registry, when any model serves LoRA adapters."""
    if not any(block.lora.active for block in config.models):
        return None
    name = f"{REGISTRY_NAME}.{app_name}"
    return AdapterRegistry(config, RayTable(name, timeout_s=config.engine_wait_timeout_s))


def served_models(
    models: list[ModelHandles], registry: AdapterRegistry | None = None
) -> ServedModels:
    """Dispatch over ``models`` (the first is the primary) and the registry's adapters."""
    return ServedModels([m.serving for m in models], registry)
