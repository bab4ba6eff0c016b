"""Spans of the preprocessor and the engine, written after the fact from recorded timestamps."""

from __future__ import annotations

import time

from serve_app.hops import EngineRequest, EngineStep, PreprocessRequest, PreprocessResult
from serve_app.observability import tracing


def preprocess_spans(
    requests: list[PreprocessRequest], results: list[PreprocessResult], started_ns: int
) -> None:
    """One span per request, from the router's send through the aggregation window to tokens."""
    end_ns = time.time_ns()
    for request, result in zip(requests, results, strict=True):
        span = tracing.tracer().start_span(
            "preprocess",
            context=tracing.context_of(request.trace_context),
            start_time=request.sent_at_ns or started_ns,
        )
        span.set_attributes(
            {
                "serve_app.window.size": len(requests),
                "serve_app.window.wait_ms": round((started_ns - request.sent_at_ns) / 1e6, 3),
                "gen_ai.usage.input_tokens": sum(len(p.token_ids) for p in result.prompts),
                "serve_app.error": result.error.message if result.error else "",
            }
        )
        span.end(end_time=end_ns)


def engine_spans(
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
