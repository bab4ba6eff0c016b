"""The Engine deployment: a thin Serve adapter over the plain ``VLLMEngine``."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from serve_app.config import AppConfig
from serve_app.config.autoscaling import QUEUE_METRIC
from serve_app.engine.batch_lines import BatchLines
from serve_app.engine.routing.policy import KV_CACHE_TOKENS
from serve_app.engine.step_outbox import StepOutbox
from serve_app.errors import APIError, ErrorInfo
from serve_app.hops import AdapterRef, EngineRequest, EngineStep
from serve_app.observability import spans, tracing

logger = logging.getLogger("serve_app.engine")
# After a dead or hung engine's requests got their errors: long enough for those to reach the
# callers, short enough that routers stop sending new work to an idle-looking dead replica.
EXIT_AFTER_S = 2.0


@serve.deployment(name="Engine")
class EngineDeployment:
    """Owns one vLLM AsyncLLM; streams engine steps back through the handle."""

    def __init__(self, config: dict[str, Any]) -> None:
        # Wall-clock stamps of this replica's start (loadtest.startup breaks start-up down).
        self.started = {"constructor": time.time()}
        from serve_app.engine.vllm_engine import VLLMEngine
        from serve_app.models import resolve_model

        self.config = AppConfig.model_validate(config)
        tracing.configure(self.config.tracing.exporter)
        self.engine = VLLMEngine(
            self.config, resolve_model(self.config.model.name), on_dead=self._exit_soon
        )
        self.started["vllm imported"] = self.engine.imported_at
        self.started["engine ready"] = time.time()
        self.batch_lines = BatchLines(self.config.batch_api.replay_window_s())
        self.outbox = StepOutbox()

    def _exit_soon(self, why: str) -> None:
        """The engine died or hung and its requests were failed: take the replica down too.
        Routers then drop it at once (a dead replica looks idle and would draw traffic until
        it failed three health checks) and Serve starts a replacement."""
        logger.error("%s; this engine replica exits in %g s to be replaced", why, EXIT_AFTER_S)
        threading.Timer(EXIT_AFTER_S, os._exit, args=(1,)).start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep | ErrorInfo]:
        # Errors travel as values: exceptions crossing Ray lose their OpenAI fields.
        started_ns, first_ns, last = time.time_ns(), 0, None
        outbox = self.outbox if request.reply_to else None
        try:
            async for step in self.batch_lines.generate(request, self.engine.generate):
                if not first_ns and any(c.token_ids for c in step.chunks):
                    first_ns = time.time_ns()
                last = step
                if outbox is not None:  # Batched with this loop turn's other steps.
                    outbox.send(request.reply_to, request.reply_key, step)
                else:
                    yield step
        except APIError as exc:
            yield exc.info
        finally:
            if tracing.enabled() and request.trace_context:
                spans.engine_spans(request, started_ns, first_ns, last)

    def finished_spans(self) -> list[dict[str, Any]]:
        return tracing.finished_spans()

    def batch_line_counts(self, batch_id: str) -> dict[str, int]:
        """What this replica did with a batch's lines: submitted to vLLM, completed (and
        distinct request ids completed), joined and replayed re-submissions."""
        return self.batch_lines.counts(batch_id)

    def num_unfinished(self) -> int:
        return self.engine.num_unfinished()

    def startup_stamps(self) -> dict[str, float]:
        return dict(self.started)

    def step_channel_counts(self) -> dict[str, int]:
        """Steps sent over the step channel, in how many frames, and how many were dropped."""
        box = self.outbox
        return {"steps": box.steps, "frames": box.frames, "dropped": box.dropped}

    def engine_args(self) -> dict[str, Any]:
        return self.engine.resolved_args

    def vllm_config(self, paths: list[str]) -> dict[str, Any]:
        """The running engine's resolved settings by dotted path, e.g.
        ``model_config.max_logprobs`` (what vllm_args really changed)."""
        return self.engine.vllm_config_values(paths)

    async def load_adapter(self, adapter: AdapterRef) -> ErrorInfo | None:
        """Load a LoRA adapter into this replica now (POST /v1/load_lora_adapter validates a
        new adapter this way); None when loaded, else the error for the client."""
        try:
            await self.engine.lora_request(adapter)
        except APIError as exc:
            return exc.info
        return None

    def loaded_adapters(self) -> list[str]:
        """``name@generation`` of the adapters this replica loaded (tests, debugging)."""
        adapters = self.engine.adapters
        return adapters.loaded() if adapters is not None else []

    async def check_health(self) -> None:
        """Serve's periodic probe (cached state only): raises once the engine died or hung;
        the router's readiness counts only replicas that pass it."""
        await self.engine.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue depth (vLLM running + waiting) for ``EngineQueuePolicy``."""
        return {QUEUE_METRIC: float(self.engine.num_unfinished())}

    def record_routing_stats(self) -> dict[str, int]:
        """Serve passes this to the engine's request router: the KV cache size sizes its
        index of what this replica holds."""
        return {KV_CACHE_TOKENS: self.engine.kv_cache_tokens()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        outbox = getattr(self, "outbox", None)
        if outbox is not None:  # Open ZeroMQ sockets can hold the process at exit.
            outbox.close()
