"""OpenTelemetry tracing: one provider per process, W3C context carried in the hop messages.

Exporters follow the standard ``OTEL_*`` variables (``OTEL_TRACES_EXPORTER=otlp|console|none``,
``OTEL_EXPORTER_OTLP_PROTOCOL``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``);
``memory`` keeps spans in the process for tests. Off by default: the API's no-op tracer then
costs a function call per span, and no context is injected into messages.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_state: dict[str, Any] = {"exporter": None, "memory": None}


def configure(exporter: str | None = None) -> str:
    """Install this process's tracer provider once; returns the exporter in use."""
    if _state["exporter"] is not None:
        return str(_state["exporter"])
    name = (exporter or os.environ.get("OTEL_TRACES_EXPORTER") or "none").lower()
    _state["exporter"] = name
    if name == "none":
        return name
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "serve_app")})
    provider = TracerProvider(resource=resource)
    if name == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        _state["memory"] = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_state["memory"]))
    elif name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif name == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: use otlp, console, memory or none")
    trace.set_tracer_provider(provider)
    return name


def _otlp_exporter() -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


def enabled() -> bool:
    return _state["exporter"] not in (None, "none")


def tracer() -> trace.Tracer:
    return trace.get_tracer("serve_app")


def extract(headers: Mapping[str, str]) -> Context:
    """The caller's context from W3C ``traceparent``/``tracestate`` headers (or a new trace)."""
    return _PROPAGATOR.extract(carrier=dict(headers))


def inject(span: trace.Span | None = None) -> dict[str, str]:
    """A carrier for hop messages; empty when tracing is off."""
    if not enabled():
        return {}
    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def keyed_context(key: str) -> Context:
    """A parent context whose trace id is derived from ``key``: whichever process does the work
    of ``key`` (a batch line run again after a takeover), its spans land in one trace."""
    digest = hashlib.sha256(key.encode()).digest()
    parent = trace.SpanContext(
        trace_id=int.from_bytes(digest[:16], "big") or 1,
        span_id=int.from_bytes(digest[16:24], "big") or 1,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def context_of(carrier: Mapping[str, str] | None) -> Context | None:
    return _PROPAGATOR.extract(carrier=dict(carrier)) if carrier else None


def traceparent(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def monotonic_to_ns(ts: float) -> int:
    """Wall-clock ns of a ``time.monotonic()`` stamp (vLLM's engine-core timestamps)."""
    return time.time_ns() - int((time.monotonic() - ts) * 1e9)


def finished_spans() -> list[dict[str, Any]]:
    """Spans kept by the ``memory`` exporter, as plain dicts (for tests)."""
    memory = _state["memory"]
    if memory is None:
        return []
    out = []
    for span in memory.get_finished_spans():
        ctx = span.get_span_context()
        out.append(
            {
                "name": span.name,
                "trace_id": f"{ctx.trace_id:032x}",
                "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                "start_ns": span.start_time,
                "end_ns": span.end_time,
                "attributes": dict(span.attributes or {}),
            }
        )
    return out


def request_attributes(stats: Any, status: int) -> dict[str, Any]:
    """Span attributes after the OpenTelemetry gen_ai conventions."""
    usage = stats.usage
    attributes: dict[str, Any] = {
        "gen_ai.system": "vllm",
        "gen_ai.request.model": stats.model,
        "gen_ai.response.id": stats.request_id,
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.response.finish_reasons": sorted(stats.finish_reasons),
        "http.response.status_code": status,
        "serve_app.cached_tokens": usage.cached_tokens,
    }
    if (ttft := stats.ttft_s()) is not None:
        attributes["serve_app.ttft_ms"] = round(ttft * 1000, 2)
    return attributes
