"""Hop messages to vLLM objects and back: ``SamplingParams`` in, ``EngineStep`` out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serve_app.hops import EngineChunk, EngineRequest, EngineStep, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from vllm import SamplingParams


def to_sampling_params(request: EngineRequest) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = request.sampling
    structured = None
    if spec.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(**{spec.structured.kind: spec.structured.value})
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


def _timings(output: Any) -> tuple[float, float, float, float] | None:
    stats = getattr(output, "metrics", None)
    if stats is None or not getattr(stats, "queued_ts", 0):
        return None
    return (stats.queued_ts, stats.scheduled_ts, stats.first_token_ts, stats.last_token_ts)
