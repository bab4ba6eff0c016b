"""The Serve request router adapter and its config, driven without a cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest

from serve_app.app import engine_options
from serve_app.config import AppConfig, RoutingConfig
from serve_app.engine.routing.options import RAY_PREFIX_CACHE_ROUTER, request_router_config
from serve_app.engine.routing.serve_router import (
    PrefixAwareRequestRouter,
    RequestKeys,
    request_keys,
)
from serve_app.hops import ChannelOpen, EngineRequest, LoraAdapter, SamplingSpec
from serve_app.preprocess.block_hashes import block_hashes

DEPLOYMENT = DeploymentID(name="Engine", app_name="llm")


def hashes(seed: int, shared: int = 1) -> tuple[int, ...]:
    tokens = [(shared * 7919 + i * 31) % 50_000 for i in range(256)] + [seed] * 64
    return block_hashes(tokens, 64)


def engine_request(block_hashes: tuple[int, ...] = (), session: str | None = None) -> EngineRequest:
    return EngineRequest(
        "r", [72, 105], SamplingSpec(), block_hashes=block_hashes, session_key=session
    )


def pending(request: Any) -> PendingRequest:
    meta = RequestMetadata(request_id="x", internal_request_id="x")
    return PendingRequest(args=[request], kwargs={}, metadata=meta, future=None)  # type: ignore[arg-type]


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that must not wait (the queue-length cache is warm)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the router waited on something")


class FakeReplica:
    """The attributes Serve's router reads from a RunningReplica."""

    def __init__(self, name: str, kv_cache_tokens: int) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.max_ongoing_requests = 8
        self.node_id, self.availability_zone = "n", None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats = {"kv_cache_tokens": kv_cache_tokens}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


async def started_router() -> tuple[PrefixAwareRequestRouter, list[FakeReplica]]:
    """A router over three replicas (spill margin 2) in the running event loop."""
    rr = PrefixAwareRequestRouter(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    rr.initialize_state(**RoutingConfig(spill_margin=2, spill_ratio=0).model_dump(mode="json"))
    replicas = [FakeReplica(f"e{i}", 64 * 1000) for i in range(3)]
    rr.update_replicas(replicas)  # type: ignore[arg-type]
    await asyncio.sleep(0.01)  # Serve's first probe fills the queue-length cache.
    return rr, replicas


@pytest.fixture()
def router() -> tuple[PrefixAwareRequestRouter, list[FakeReplica]]:
    return asyncio.run(started_router())


def test_ranks_the_affine_replica_first_and_forgets_dead_ones(router: Any) -> None:
    rr, _ = router
    assert all(rr.policy.index.capacity(r) == 1000 for r in rr.policy.index.replicas())
    ranks = run(rr.choose_replicas(rr._replicas_list, pending(engine_request(hashes(0)))))
    home = ranks[0][0]
    assert len(ranks) == 2 and home not in ranks[1] and len(ranks[1]) == 2
    for s in range(1, 5):
        pr = pending(engine_request(hashes(s)))
        assert run(rr.choose_replicas(rr._replicas_list, pr))[0] == [home]
        rr.on_request_routed(pr, home.replica_id, None)  # Accepted (and already finished).
    # A full replica (the cache says max_ongoing_requests) is never ranked first.
    rr.replica_queue_len_cache.update(home.replica_id, home.max_ongoing_requests)
    pr = pending(engine_request(hashes(9)))
    assert run(rr.choose_replicas(rr._replicas_list, pr))[0][0] is not home
    # A dead replica is forgotten at once, before the controller's broadcast.
    rr.replica_queue_len_cache.update(home.replica_id, 0)
    rr.on_replica_actor_died(home.replica_id)
    assert home.replica_id.unique_id not in rr.policy.index.replicas()
    pr = pending(engine_request(hashes(10)))
    assert run(rr.choose_replicas(rr._replicas_list, pr))[0][0] is not home
    assert rr.policy.counts["affinity"] >= 4


def test_records_where_serve_actually_sent_it(router: Any) -> None:
    rr, replicas = router
    pr = pending(engine_request(hashes(0)))
    first = run(rr.choose_replicas(rr._replicas_list, pr))[0][0]
    other = next(r for r in replicas if r is not first)
    rr.on_request_routed(pr, other.replica_id, None)  # Serve fell back to the second rank.
    owners = rr.policy.index.owners(hashes(0)[0])
    assert owners == {first.replica_id.unique_id, other.replica_id.unique_id}


def test_one_replica_is_chosen_without_a_probe_and_still_indexed(router: Any) -> None:
    rr, replicas = router
    (only,) = replicas[:1]

    async def never(*, deadline_s: float) -> int:
        raise AssertionError("probed the only replica")

    only.get_queue_len = never
    rr.replica_queue_len_cache.invalidate_key(only.replica_id)
    pr = pending(engine_request(hashes(0)))
    assert run(rr.choose_replicas([only], pr)) == [[only]]
    rr.on_request_routed(pr, only.replica_id, None)
    assert rr.policy.index.owners(hashes(0)[-1]) == {only.replica_id.unique_id}


def test_an_output_channel_goes_to_its_named_replica_or_nowhere(router: Any) -> None:
    rr, replicas = router
    for replica in replicas:  # Whatever the load, never another replica.
        rr.replica_queue_len_cache.update(replica.replica_id, 0)
    rr.replica_queue_len_cache.update(replicas[1].replica_id, 7)
    opening = pending(ChannelOpen("router-a", replicas[1].replica_id.unique_id))
    assert run(rr.choose_replicas(rr._replicas_list, opening)) == [[replicas[1]]]
    gone = pending(ChannelOpen("router-a", "a-replaced-replica"))
    assert run(rr.choose_replicas(rr._replicas_list, gone)) == []
    assert run(rr.choose_replicas([replicas[0]], gone)) == []  # Not even the only one.


def test_request_keys_read_the_engine_request_or_the_handle_session() -> None:
    assert request_keys(pending(engine_request((), session="abc"))) == RequestKeys((), "abc")
    pr = pending(engine_request((1, 2)))
    pr.metadata.session_id = "from-handle-options"
    assert request_keys(pr) == RequestKeys((1, 2), "from-handle-options")
    assert request_keys(pending("no hashes here")) == RequestKeys()
    assert request_keys(None) == RequestKeys()
    lora = replace(engine_request(), lora=LoraAdapter("poet", "/adapters/poet"))
    assert request_keys(pending(lora)) == RequestKeys((), None, "poet")


def test_engine_options_carry_the_request_router_config() -> None:
    options = engine_options(AppConfig())
    router = options["request_router_config"]
    assert router.request_router_class.endswith("serve_router.PrefixAwareRequestRouter")
    assert router.request_router_kwargs["spill_margin"] == 8
    default = AppConfig.model_validate({"engine": {"routing": {"policy": "default"}}})
    assert "request_router_config" not in engine_options(default)


@pytest.mark.parametrize(("routers", "cold"), [(1, "least_loaded"), (3, "hrw"), ("auto", "hrw")])
def test_cold_placement_auto_follows_the_number_of_router_replicas(
    routers: int | str, cold: str
) -> None:
    config = AppConfig.model_validate({"router": {"num_replicas": routers, "max_replicas": 3}})
    kwargs = engine_options(config)["request_router_config"].request_router_kwargs
    assert kwargs["cold_placement"] == cold


def test_ray_prefix_cache_policy_gets_finite_balance_and_eviction() -> None:
    config = request_router_config(RoutingConfig(policy="ray_prefix_cache", spill_margin=4))
    assert config is not None and config.request_router_class == RAY_PREFIX_CACHE_ROUTER
    kwargs = config.request_router_kwargs
    assert kwargs["imbalanced_threshold"] == 4 and kwargs["do_eviction"] is True
    assert kwargs["eviction_target_chars"] < kwargs["eviction_threshold_chars"]


def test_ray_prefix_cache_router_reads_token_ids_as_text() -> None:
    """Ray's router matches `.prompt` text; EngineRequest gives one character per token."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    rr = object.__new__(PrefixCacheAffinityRouter)  # Extraction touches no state.
    request = EngineRequest("r", [72, 105, 200_000], SamplingSpec())
    assert rr._extract_text_from_request(pending(request)) == "Hi" + chr(200_000)


def test_a_burst_routed_at_once_sees_its_own_picks() -> None:
    """An aggregation window's requests reach the router together, often on an expired
    queue-length cache: each waits for Serve's probe, then all decide on the same empty
    queues. Counting the picks not yet sent, the burst spills past the margin (2) instead of
    landing on the replica that holds the prefix."""

    async def burst() -> tuple[Any, list[Any], PrefixAwareRequestRouter]:
        rr, replicas = await started_router()
        first = pending(engine_request(hashes(0)))
        home = (await rr.choose_replicas(rr._replicas_list, first))[0][0]
        rr.on_request_routed(first, home.replica_id, None)
        for replica in replicas:
            rr.replica_queue_len_cache.invalidate_key(replica.replica_id)  # Expired.
        calls = [
            rr.choose_replicas(rr._replicas_list, pending(engine_request(hashes(0))))
            for _ in range(8)
        ]
        return home, [ranks[0][0] for ranks in await asyncio.gather(*calls)], rr

    home, chosen, rr = asyncio.run(burst())
    on_home = sum(replica is home for replica in chosen)
    assert 1 <= on_home <= 3 and len(set(map(id, chosen))) >= 2, on_home
    for replica in chosen:  # Serve sends them: its cache counts them, our picks go.
        rr.on_send_request(replica.replica_id)
    assert not rr._picked()


def test_calls_sharing_an_internal_request_id_are_all_routed() -> None:
    """A handle call inherits its internal_request_id from the HTTP request that made it, so the
    engine calls of one multi-prompt completion share one. Serve's own routing loop (driven
    here) hands each chosen replica to the pending request with that id: without our match on
    the call itself, all but one call never got a replica (a 503 after engine_wait_timeout_s)."""

    async def route_siblings() -> list[Any]:
        rr, _ = await started_router()
        siblings = []
        for prompt in range(4):
            meta = RequestMetadata(request_id="http-1", internal_request_id="http-1")
            request = engine_request(hashes(prompt, shared=prompt))
            siblings.append(PendingRequest(args=[request], kwargs={}, metadata=meta))
        calls = [rr._choose_replica_for_request(pr) for pr in siblings]
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout=10))

    chosen = asyncio.run(route_siblings())
    assert len(chosen) == 4 and all(replica is not None for replica in chosen)
