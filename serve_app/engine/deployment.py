"""The Engine deployment: the plain ``VLLMEngine`` as a Serve replica, plus its spans."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.config.autoscaling import QUEUE_METRIC
from serve_app.engine.channels import ChannelItem, OutputChannels, through_outbox
from serve_app.engine.routing.policy import KV_CACHE_TOKENS
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import (
    ChannelOffer,
    ChannelOpen,
    EngineRequest,
    EngineStep,
    LoraAdapter,
    OnChannel,
)
from serve_app.observability import tracing

FAULT_SESSION_KEY = "serve_app:fault"  # With engine.inject_faults (tests only).


@serve.deployment(name="Engine")
class EngineDeployment:
    """Owns one vLLM AsyncLLM; streams engine steps back through the handle call, or through
    the caller's output channel when it has one open here (``serve_app.engine.channels``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from serve_app.engine.vllm_engine import VLLMEngine
        from serve_app.models import resolve_model

        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.engine = VLLMEngine(self.config, resolve_model(self.config.model.name))
        self.channels = OutputChannels()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def generate(
        self, request: EngineRequest
    ) -> AsyncIterator[EngineStep | ErrorInfo | OnChannel | ChannelOffer]:
        if self.config.engine.inject_faults and request.session_key == FAULT_SESSION_KEY:
            raise RuntimeError("fault injected (engine.inject_faults)")
        outbox = self.channels.outbox(request.channel)
        if outbox is None:
            direct: AbstractContextManager[object] = nullcontext()
            if request.channel is not None:
                yield ChannelOffer(self.replica_id)
                direct = self.channels.streaming_directly(request.channel)
            with direct:
                async for item in self._steps(request):
                    yield item
            return
        outbox.begin()  # Before OnChannel: the channel must not idle out in between.
        try:
            yield OnChannel(self.replica_id)
            await through_outbox(outbox, request.request_id, self._steps(request))
        finally:
            outbox.end()

    async def open_channel(self, request: ChannelOpen) -> AsyncIterator[list[ChannelItem]]:
        """The caller's output channel (``engine.channels``): batches of its streams' steps."""
        if request.target_replica != self.replica_id:
            return  # Meant for a replica this one replaced: the caller gives that id up.
        async for batch in self.channels.open(request.caller):
            yield batch

    async def _steps(self, request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
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

    async def add_lora(self, adapter: LoraAdapter) -> ErrorInfo | None:
        """Load a runtime adapter on this replica now (the others load it on first use)."""
        try:
            await self.engine.add_lora(adapter)
        except APIError as exc:
            return exc.info
        return None

    def num_unfinished(self) -> int:
        return self.engine.num_unfinished()

    def engine_args(self) -> dict[str, Any]:
        return self.engine.resolved_args

    def resolved_engine_args(self, names: list[str]) -> dict[str, Any]:
        """Read back from the running engine, e.g. what ``engine.vllm_args`` set."""
        return self.engine.resolved_engine_args(names)

    async def check_health(self) -> None:
        """Serve's periodic probe: raises when vLLM's engine core is dead (replica replaced)."""
        await self.engine.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue depth (vLLM running + waiting) for ``autoscaling.EngineQueuePolicy``."""
        return {QUEUE_METRIC: float(self.engine.num_unfinished())}

    def record_routing_stats(self) -> dict[str, int]:
        """Read by the request router in every caller (``routing.serve_router``): the KV cache
        size sizes its index of what this replica holds."""
        return {KV_CACHE_TOKENS: self.engine.kv_cache_tokens()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


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
            "serve_app.priority": request.priority,
            "serve_app.tenant": request.tenant,
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
