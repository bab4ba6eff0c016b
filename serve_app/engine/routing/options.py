"""engine.routing -> the Engine deployment's ``RequestRouterConfig`` (None: Serve's default)."""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

from serve_app.config.routing import RoutingConfig
from serve_app.engine.routing.policy import DEFAULT_INDEX_BLOCKS

# Ray Serve LLM's router, by its internal path: the public ray.serve.llm.request_router path
# imports vLLM into every caller (~16 s at start).
RAY_PREFIX_CACHE_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
    "PrefixCacheAffinityRouter"
)


def request_router_config(
    routing: RoutingConfig, callers: int | None = 1
) -> RequestRouterConfig | None:
    """``callers``: processes that route to the engine, each with its own index (the Router
    replicas; None when they autoscale)."""
    # Ray annotates RequestRouterConfig(**kwargs: dict[str, Any]): the ignores are for that.
    if routing.policy == "default":
        return None
    if routing.policy == "ray_prefix_cache":
        # Its defaults never balance load and never evict; give it our margin and index size
        # (its "characters" are our tokens: EngineRequest.prompt is one character per token).
        chars = (routing.index_blocks_per_replica or DEFAULT_INDEX_BLOCKS) * routing.block_size
        return RequestRouterConfig(
            request_router_class=RAY_PREFIX_CACHE_ROUTER,  # type: ignore[arg-type]
            request_router_kwargs={
                "imbalanced_threshold": routing.spill_margin,
                "do_eviction": True,
                "eviction_threshold_chars": chars,
                "eviction_target_chars": chars * 9 // 10,
            },
        )
    from serve_app.engine.routing.serve_router import PrefixAwareRequestRouter

    if routing.cold_placement == "auto":
        routing = routing.model_copy(
            update={"cold_placement": "least_loaded" if callers == 1 else "hrw"}
        )
    return RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,  # type: ignore[arg-type]
        request_router_kwargs=routing.model_dump(mode="json"),
    )
