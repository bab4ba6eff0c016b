"""Request metrics through Ray's metrics API (so they show in the Ray dashboard and its
Prometheus export), plus one structured log line per request.

Engine-side metrics (running/waiting requests, KV-cache usage, prefix-cache hits, preemptions,
vLLM's TTFT/TPOT/queue histograms) come from vLLM's own Ray stat logger in the engine replica.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_app.openai.serving import RequestStats

logger = logging.getLogger("serve_app.requests")

_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_TOKEN_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5]
_WINDOW_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]


class RouterMetrics:
    def __init__(self, application: str = "") -> None:
        from ray.util import metrics

        tags = ("route", "model")
        self.requests = metrics.Counter(
            "serve_app_requests_total",
            "HTTP requests by route, status and model.",
            tag_keys=("route", "status", "model"),
        )
        self.latency = metrics.Histogram(
            "serve_app_request_latency_seconds",
            "End-to-end request latency.",
            boundaries=_LATENCY_BUCKETS,
            tag_keys=tags,
        )
        self.ttft = metrics.Histogram(
            "serve_app_time_to_first_token_seconds",
            "Time to first token at the router.",
            boundaries=_LATENCY_BUCKETS,
            tag_keys=tags,
        )
        self.tpot = metrics.Histogram(
            "serve_app_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            boundaries=_TOKEN_TIME_BUCKETS,
            tag_keys=tags,
        )
        self.prompt_tokens = metrics.Counter(
            "serve_app_prompt_tokens_total", "Prompt tokens processed.", tag_keys=tags
        )
        self.generation_tokens = metrics.Counter(
            "serve_app_generation_tokens_total", "Tokens generated.", tag_keys=tags
        )
        self.resubmissions = metrics.Counter(
            "serve_app_engine_resubmissions_total",
            "Engine requests resubmitted because their engine went away before the first token.",
            tag_keys=("application", "model"),
        )
        self.resubmissions.set_default_tags({"application": application})
        self.channel_streams = metrics.Counter(
            "serve_app_engine_channel_streams_total",
            "Streamed engine requests whose steps came through an output channel (one message "
            "per engine step for all of a router's streams on a replica: engine.output_channels).",
            tag_keys=("application", "model"),
        )
        self.channel_streams.set_default_tags({"application": application})

    def record(self, stats: RequestStats, status: int) -> None:
        tags = {"route": stats.route, "model": stats.model}
        latency = time.perf_counter() - stats.started
        self.requests.inc(1, tags | {"status": str(status)})
        self.latency.observe(latency, tags)
        usage = stats.usage
        if usage.prompt_tokens:
            self.prompt_tokens.inc(usage.prompt_tokens, tags)
        if usage.completion_tokens:
            self.generation_tokens.inc(usage.completion_tokens, tags)
        ttft = stats.ttft_s()
        if ttft is not None:
            self.ttft.observe(ttft, tags)
            if usage.completion_tokens > 1:
                self.tpot.observe((latency - ttft) / (usage.completion_tokens - 1), tags)
        log_request(stats, status, latency)


def log_request(stats: RequestStats, status: int, latency: float) -> None:
    record: dict[str, Any] = {
        "request_id": stats.request_id,
        "route": stats.route,
        "model": stats.model,
        "status": status,
        "prompt_tokens": stats.usage.prompt_tokens,
        "completion_tokens": stats.usage.completion_tokens,
        "cached_tokens": stats.usage.cached_tokens,
        "latency_ms": round(latency * 1000, 1),
        "ttft_ms": None if (t := stats.ttft_s()) is None else round(t * 1000, 1),
        "finish_reasons": sorted(stats.finish_reasons),
    }
    logger.info(json.dumps(record))


class WindowMetrics:
    """The preprocessor's aggregation window (Serve's ``@serve.batch``): how many requests share
    one and how long they wait for it.

    The same numbers also go out under their old names (``serve_app_preprocess_batch_size``,
    ``serve_app_preprocess_batch_wait_seconds``) for one release, for dashboards built on them.
    """

    def __init__(self) -> None:
        from ray.util import metrics

        self.size = metrics.Histogram(
            "serve_app_aggregation_window_size",
            "Requests tokenized together in one aggregation window.",
            boundaries=_WINDOW_BUCKETS,
        )
        self.wait = metrics.Histogram(
            "serve_app_aggregation_window_wait_seconds",
            "Time from the router's send to the start of the window's tokenization.",
            boundaries=_TOKEN_TIME_BUCKETS,
        )
        self.old_size = metrics.Histogram(
            "serve_app_preprocess_batch_size",
            "Old name of serve_app_aggregation_window_size (goes away in the next release).",
            boundaries=_WINDOW_BUCKETS,
        )
        self.old_wait = metrics.Histogram(
            "serve_app_preprocess_batch_wait_seconds",
            "Old name of serve_app_aggregation_window_wait_seconds (goes away in the next "
            "release).",
            boundaries=_TOKEN_TIME_BUCKETS,
        )

    def record(self, size: int, waits: list[float]) -> None:
        self.size.observe(size)
        self.old_size.observe(size)
        for wait in waits:
            self.wait.observe(max(wait, 0.0))
            self.old_wait.observe(max(wait, 0.0))


class RoutingMetrics:
    """The engine request router's decisions: affinity (cache hit expected) vs spill-over."""

    def __init__(self, application: str, deployment: str) -> None:
        from ray.util import metrics

        self.decisions = metrics.Counter(
            "serve_app_routing_decisions_total",
            "Engine routing decisions by reason (affinity: to the replica holding the longest "
            "prefix; spill: it was too busy; session: session affinity; adapter: a LoRA "
            "adapter's home replica; balance: nothing to match) and chosen replica.",
            tag_keys=("application", "deployment", "reason", "replica"),
        )
        self.decisions.set_default_tags({"application": application, "deployment": deployment})

    def record(self, reason: str, replica: str) -> None:
        self.decisions.inc(1, {"reason": reason, "replica": replica})
