"""The engine behind a small protocol; ``VLLMEngine`` (one vLLM ``AsyncLLM``) is the real one.

The engine is fed token ids (the preprocessor already tokenized), streams deltas, and aborts the
vLLM request when its consumer goes away (``AsyncLLM.generate`` aborts on cancellation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from serve_app.config import AppConfig
from serve_app.engine import cpu_pinning
from serve_app.engine.admission import BackgroundGate
from serve_app.engine.conversions import to_engine_step, to_sampling_params
from serve_app.engine.fair_share import FairQueue, FairShareGate
from serve_app.engine.lora import EngineAdapters
from serve_app.engine.vllm_args import engine_args, vllm_engine_args
from serve_app.engine.watchdog import EngineWatchdog
from serve_app.errors import APIError, inject_fault
from serve_app.hops import AdapterRef, EngineRequest, EngineStep

logger = logging.getLogger("serve_app.engine")


class Engine(Protocol):
    """What the serving layer needs from an engine."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]: ...

    def num_unfinished(self) -> int:
        """Requests the engine still holds (running or waiting)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def _ray_stat_loggers() -> list[Any] | None:
    """vLLM's metrics through Ray's metrics API, when running inside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return None
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]


class VLLMEngine:
    """One vLLM ``AsyncLLM`` in this process (its engine core runs in a child process)."""

    def __init__(
        self,
        config: AppConfig,
        model_path: str,
        offline: bool = False,
        on_dead: Callable[[str], Any] | None = None,
    ) -> None:
        """``offline``: an offline batch job's engine, whose unset limits get the defaults of
        vLLM's offline ``LLM`` (e.g. a larger prefill budget per step) instead of its server's.
        ``on_dead(why)``: called once the watchdog failed a dead or hung engine."""
        args = engine_args(config, model_path)
        logger.info("Starting vLLM AsyncLLM with %s", args)
        self.resolved_args = args
        bind = config.engine.cpu_threads_bind if config.engine.resolved_device() == "cpu" else ""
        engine = config.engine
        # A stat logger is vLLM's per-step callback: the watchdog's progress signal.
        self._watchdog = EngineWatchdog(stall_timeout_s=engine.stall_timeout_s, on_fail=on_dead)
        with cpu_pinning.engine_isolation(bind, ranks=engine.world_size):
            # vLLM's import too (seconds of CPU): outside, a replica Ray confined to one core
            # would import it there, next to every other replica starting, beside an idle core.
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            self.imported_at = time.time()
            self._llm = AsyncLLM.from_engine_args(
                vllm_engine_args(args, AsyncEngineArgs),
                stat_loggers=[*(_ray_stat_loggers() or []), self._watchdog.stat_logger],
                usage_context=UsageContext.LLM_CLASS if offline else UsageContext.OPENAI_API_SERVER,
            )
        self.max_model_len: int = self._llm.model_config.max_model_len
        self._watchdog.attach(self._llm)
        self._fault_injection = config.fault_injection
        self._running: set[str] = set()  # Request ids in this engine now: none runs twice.
        self._background = BackgroundGate(
            max(1, engine.max_num_seqs - engine.interactive_reserved_seqs)
        )
        fair = engine.fair_share
        self._fair = (
            FairShareGate(engine.max_num_seqs, FairQueue(fair.weights, fair.default_weight))
            if fair.enabled
            else None
        )
        lora = config.lora
        self.adapters = (
            EngineAdapters(
                self._llm.add_lora,
                self._llm.remove_lora,
                capacity=max(16, 4 * (lora.max_cpu_loras or lora.max_loras)),
            )
            if lora.active
            else None
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        self._watchdog.ensure_running()
        inject_fault(self._fault_injection, request.sampling.stop, "engine")
        if request.request_id in self._running:  # A re-submission must never run twice.
            raise APIError(
                f"Request {request.request_id} is already running on this engine replica.",
                status=409,
                code="duplicate_request_id",
            )
        self._running.add(request.request_id)
        try:
            async with self._background.slot(request.priority):
                if self._fair is None:
                    async for step in self._generate(request):
                        yield step
                    return
                async with self._fair.slot(
                    request.tenant,
                    request.priority,
                    seqs=request.sampling.n,
                    prompt_tokens=len(request.prompt_token_ids),
                ) as charge:
                    async for step in self._generate(request):
                        charge(sum(len(chunk.token_ids) for chunk in step.chunks))
                        yield step
        finally:
            self._running.discard(request.request_id)

    async def _generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        params = to_sampling_params(request)
        lora = await self.lora_request(request.lora) if request.lora is not None else None
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=request.prompt_token_ids),
            params,
            request.request_id,
            priority=request.priority,
            lora_request=lora,
        )
        try:
            async for output in stream:
                step = to_engine_step(output, request)
                if any(chunk.finish_reason == "error" for chunk in step.chunks):
                    raise _generation_failed(request)
                yield step
        except EngineDeadError as exc:
            raise APIError(
                f"The engine died ({exc}); the replica is being replaced, retry shortly.",
                status=503,
                type="server_error",
                code="engine_unavailable",
            ) from exc
        except (ValueError, VLLMClientError) as exc:  # vLLM's checks we did not pre-empt.
            raise APIError(str(exc), param=getattr(exc, "parameter", None)) from exc
        finally:
            await stream.aclose()

    async def lora_request(self, adapter: AdapterRef) -> Any:
        """vLLM's ``LoRARequest`` for ``adapter``, loaded into this engine first if needed."""
        if self.adapters is None:
            raise APIError(f"This model serves no LoRA adapters ('{adapter.name}').", status=404)
        return await self.adapters.request_for(adapter)

    def vllm_config_values(self, paths: list[str]) -> dict[str, Any]:
        """Values of the running engine's resolved config by dotted path
        (``cache_config.cache_dtype``), as vLLM resolved them: what the engine really runs."""
        values: dict[str, Any] = {}
        for path in paths:
            value: Any = self._llm.vllm_config
            for part in path.split("."):
                value = getattr(value, part, None)
            ok = value is None or isinstance(value, str | int | float | bool)
            values[path] = value if ok else str(value)
        return values

    def num_unfinished(self) -> int:
        """Requests the engine still holds (running or waiting)."""
        held_back = self._background.waiting + (self._fair.waiting if self._fair else 0)
        return int(self._llm.output_processor.get_num_unfinished_requests()) + held_back

    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds (blocks x block size), as the engine core sized it."""
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def check_health(self) -> None:
        """Cached state only (the watchdog's verdict, vLLM's dead flag): never waits on the
        engine core, which may be the thing that hangs."""
        self._watchdog.ensure_running()
        if self._watchdog.verdict:
            raise RuntimeError(self._watchdog.verdict)
        await self._llm.check_health()

    def shutdown(self) -> None:
        self._llm.shutdown()


def _generation_failed(request: EngineRequest) -> APIError:
    """vLLM ended the request with finish_reason "error" (seen when its grammar engine rejects
    a token sampled under a constraint, e.g. with degenerate sampling parameters)."""
    structured = request.sampling.structured
    if structured is not None:
        return APIError(
            "The engine could not follow this output constraint with these sampling parameters "
            "(its grammar rejected a sampled token); simplify the constraint or use the default "
            "sampling parameters.",
            param=structured.param,
            code="generation_failed",
        )
    return APIError(
        "The engine failed this request; retry it.",
        status=500,
        type="server_error",
        code="generation_failed",
    )
