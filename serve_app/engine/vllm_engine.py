"""The engine behind a small protocol; ``VLLMEngine`` (one vLLM ``AsyncLLM``) is the real one.

The engine is fed token ids (the preprocessor already tokenized), streams deltas, and aborts the
vLLM request when its consumer goes away (``AsyncLLM.generate`` aborts on cancellation).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from serve_app.config import AppConfig
from serve_app.engine import cpu_pinning
from serve_app.engine.background_gate import BackgroundGate
from serve_app.engine.engine_args import engine_args, resolved_values, vllm_engine_args
from serve_app.engine.fair_share import FairQueue, FairShareGate
from serve_app.engine.lora_requests import LoraRequests
from serve_app.engine.watchdog import EngineWatchdog, StepHeartbeat
from serve_app.errors import APIError
from serve_app.hops import (
    EngineChunk,
    EngineRequest,
    EngineStep,
    LoraAdapter,
    TokenLogprob,
    TopLogprob,
)

if TYPE_CHECKING:
    from vllm import SamplingParams

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


def to_sampling_params(request: EngineRequest) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = request.sampling
    structured = None
    if spec.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        value = spec.structured.value
        if spec.structured.kind == "json" and not isinstance(value, str):
            # As text: a schema may hold numbers msgpack cannot carry to the engine core
            # (ints past 64 bits), which would fail the request there as an internal error.
            value = json.dumps(value)
        structured = StructuredOutputsParams(**{spec.structured.kind: value})
    return SamplingParams(
        n=spec.n,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        seed=spec.seed,
        stop=list(spec.stop),
        stop_token_ids=list(spec.stop_token_ids),
        include_stop_str_in_output=spec.include_stop_str_in_output,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=spec.logit_bias,
        logprobs=spec.logprobs,
        min_tokens=spec.min_tokens,
        ignore_eos=spec.ignore_eos,
        skip_special_tokens=spec.skip_special_tokens,
        structured_outputs=structured,
        # Non-streaming callers need only the end result: one message instead of one per step.
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
    )


def _finite(logprob: float) -> float:
    # Constrained decoding masks tokens to -inf, which JSON cannot carry; vLLM's server clamps too.
    return max(logprob, -9999.0)


def _convert_logprobs(token_ids: Any, logprobs: Any, top_n: int) -> list[TokenLogprob]:
    out = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        chosen = position[token_id]
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        top = tuple(
            TopLogprob(entry.decoded_token or "", _finite(entry.logprob))
            for _, entry in ranked[:top_n]
        )
        out.append(TokenLogprob(chosen.decoded_token or "", _finite(chosen.logprob), top))
    return out


def to_engine_step(output: Any, request: EngineRequest) -> EngineStep:
    """One vLLM ``RequestOutput`` as the message the serving layer and batch jobs consume."""
    top_n = request.sampling.logprobs or 0
    chunks = [
        EngineChunk(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=None
            if c.logprobs is None
            else _convert_logprobs(c.token_ids, c.logprobs, top_n),
        )
        for c in output.outputs
    ]
    return EngineStep(
        chunks=chunks,
        prompt_tokens=len(request.prompt_token_ids),
        cached_tokens=output.num_cached_tokens,
        finished=output.finished,
        timings=_timings(output) if output.finished else None,
    )


def _ray_stat_loggers() -> list[Any]:
    """vLLM's metrics through Ray's metrics API, when running inside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return []  # vLLM adds its own Prometheus logger.
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]


def _timings(output: Any) -> tuple[float, float, float, float] | None:
    stats = getattr(output, "metrics", None)
    if stats is None or not getattr(stats, "queued_ts", 0):
        return None
    return (stats.queued_ts, stats.scheduled_ts, stats.first_token_ts, stats.last_token_ts)


class VLLMEngine:
    """One vLLM ``AsyncLLM`` in this process (its engine core runs in a child process)."""

    def __init__(self, config: AppConfig, model_path: str, offline: bool = False) -> None:
        """``offline``: an offline batch job's engine, whose unset limits get the defaults of
        vLLM's offline ``LLM`` (e.g. a larger prefill budget per step) instead of its server's."""
        args = engine_args(config, model_path)
        logger.info("Starting vLLM AsyncLLM with %s", args)
        self.resolved_args = args
        bind = config.engine.cpu_threads_bind if config.engine.resolved_device() == "cpu" else ""
        heartbeat = StepHeartbeat()
        with cpu_pinning.engine_isolation(bind, config.engine.world_size):
            # Imported here: on a CPU box whose Ray is confined to one core, vLLM's import
            # (the longest step of a start) then also runs on the model's still idle cores.
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            self._llm = AsyncLLM.from_engine_args(
                vllm_engine_args(args, AsyncEngineArgs),
                stat_loggers=[*_ray_stat_loggers(), heartbeat.stat_logger_factory()],
                usage_context=UsageContext.LLM_CLASS if offline else UsageContext.OPENAI_API_SERVER,
            )
        self.max_model_len: int = self._llm.model_config.max_model_len
        self._loras = LoraRequests(bool(args.get("enable_lora")))
        self._watchdog = EngineWatchdog.for_engine(
            self._llm, heartbeat, config.engine.stall_timeout_s
        )
        engine = config.engine
        self._background = BackgroundGate(
            max(1, engine.max_num_seqs - engine.interactive_reserved_seqs)
        )
        fair = engine.fair_share
        self._fair = (
            FairShareGate(
                engine.max_num_seqs,
                FairQueue(fair.weights, fair.default_weight),
                ahead=max(1, engine.max_num_seqs // 16),
            )
            if fair.enabled
            else None
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        self._watchdog.ensure_running()
        async with self._background.slot(request.priority, request.sampling.n):
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

    async def _generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            params = to_sampling_params(request)
        except (ValueError, VLLMClientError) as exc:  # vLLM's checks we did not pre-empt.
            raise APIError(str(exc), param=getattr(exc, "parameter", None)) from exc
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=request.prompt_token_ids),
            params,
            request.request_id,
            lora_request=self._loras.get(request.lora),
            priority=request.priority,
        )
        try:
            async for output in stream:
                yield to_engine_step(output, request)
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

    async def add_lora(self, adapter: LoraAdapter) -> None:
        """Load ``adapter`` now, as a runtime load's check; what vLLM says against it is a
        404 (nothing at the path) or a 400 (e.g. a rank above max_lora_rank)."""
        request = self._loras.get(adapter)
        assert request is not None
        try:
            await self._llm.add_lora(request)
        except Exception as exc:  # The engine core's errors arrive as text, not types.
            missing = "not found" in str(exc).lower() or "no adapter" in str(exc).lower()
            raise APIError(
                f"LoRA adapter {adapter.name!r} could not be loaded from {adapter.path!r}: {exc}",
                status=404 if missing else 400,
                param="lora_path",
                code="lora_adapter_not_found" if missing else "invalid_lora_adapter",
            ) from exc

    def num_unfinished(self) -> int:
        """Requests the engine still holds (running or waiting)."""
        held_back = self._background.waiting + (self._fair.waiting if self._fair else 0)
        return int(self._llm.output_processor.get_num_unfinished_requests()) + held_back

    def resolved_engine_args(self, names: list[str]) -> dict[str, Any]:
        """What the running engine resolved for these ``EngineArgs`` names."""
        return resolved_values(self._llm.vllm_config, names)

    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds (blocks x block size), as the engine core sized it."""
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def check_health(self) -> None:
        await self._llm.check_health()

    def shutdown(self) -> None:
        self._llm.shutdown()
