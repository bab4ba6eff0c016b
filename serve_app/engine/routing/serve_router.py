"""``RoutingPolicy`` on Ray Serve's request router extension API, for the Engine deployment.

Serve builds one instance per DeploymentHandle in each process that calls the Engine (each
Router replica) and runs it on its router loop. Serve pickles this module by value into those
processes; what it imports (serve_app) must be importable there, as it is in every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from serve_app.config.routing import RoutingConfig

# The module, not its ENGINE_DEPARTURES: Serve pickles this module by value, which would copy
# the registry instead of sharing the process's one with the calls (ingress.backends).
from serve_app.engine.routing import departures
from serve_app.engine.routing.policy import KV_CACHE_TOKENS, RoutingPolicy
from serve_app.observability.metrics import RoutingMetrics

if TYPE_CHECKING:
    from ray.serve._private.common import RequestMetadata


@dataclass(frozen=True)
class RequestKeys:
    """What the policy reads off one engine call: prefix hashes (empty: route by load), the
    conversation's session key, and the LoRA adapter's name."""

    hashes: Sequence[int] = ()
    session: str | None = None
    adapter: str | None = None


def request_keys(pending: PendingRequest | None) -> RequestKeys:
    """The keys of the first argument that carries block hashes.

    Serve resolves arguments before routing starts, so ``args[0]`` is the EngineRequest
    itself. Calls without one (health checks, stats) route by load.
    """
    if pending is None:
        return RequestKeys()
    handle_session = getattr(pending.metadata, "session_id", "") or None
    for arg in (*pending.args, *pending.kwargs.values()):
        hashes = getattr(arg, "block_hashes", None)
        if hashes is not None:
            lora = getattr(arg, "lora", None)
            return RequestKeys(
                hashes,
                getattr(arg, "session_key", None) or handle_session,
                getattr(lora, "name", None),
            )
    return RequestKeys(session=handle_session)


def engine_request_id(pending: PendingRequest) -> str | None:
    """The engine request id of a generate call (its ``EngineRequest``), if it is one."""
    for arg in pending.args:
        if hasattr(arg, "block_hashes") and isinstance(getattr(arg, "request_id", None), str):
            return str(arg.request_id)
    return None


def target_replica(pending: PendingRequest) -> str | None:
    """The replica a call must go to (``ChannelOpen``), if it names one."""
    for arg in pending.args:
        target = getattr(arg, "target_replica", None)
        if isinstance(target, str):
            return target
    return None


# A pick Serve never sent (the request was cancelled first) stops counting after this long.
PICK_TTL_S = 5.0
# A replica that left the routing set with calls of ours on it: how long it has to answer a
# queue-length probe (a draining replica does; a hung one is lost), and how often it is asked
# again while those calls last (a drain can hang too).
DEPARTED_PROBE_S = 5.0
DEPARTED_PROBE_EVERY_S = 5.0


# No FIFOMixin: with it Serve hands the replica chosen for one request to whichever request
# heads the queue, which throws the prefix choice away.
class PrefixAwareRequestRouter(RequestRouter):
    """Longest cached prefix first; spill to a less loaded replica past a margin; sessions;
    a LoRA adapter's requests where the adapter is loaded."""

    def initialize_state(self, **routing: Any) -> None:
        # Called once with request_router_kwargs (engine.routing), before update_replicas.
        self._policy = RoutingPolicy(RoutingConfig.model_validate(routing))
        # Picks Serve has not yet counted in its queue-length cache (it adds one when it
        # sends): a burst routed at once (an aggregation window's worth, on an expired cache)
        # must see its own earlier picks, or every request of it lands on one replica.
        self._picks: dict[int, tuple[ReplicaID, float]] = {}
        self._departed_probes: set[asyncio.Task[None]] = set()
        deployment = self._deployment_id
        self._metrics = RoutingMetrics(deployment.app_name, deployment.name)

    @property
    def policy(self) -> RoutingPolicy:
        return self._policy

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        previous = dict(self.curr_replicas)
        super().update_replicas(replicas)
        kept = {r.replica_id for r in replicas}
        for replica_id, replica in previous.items():
            if replica_id not in kept and departures.ENGINE_DEPARTURES.watching(
                replica_id.unique_id
            ):
                with contextlib.suppress(RuntimeError):  # No running loop: nothing to watch.
                    probe = asyncio.get_running_loop().create_task(self._until_gone(replica))
                    self._departed_probes.add(probe)  # The loop keeps tasks weakly.
                    probe.add_done_callback(self._departed_probes.discard)
        self._policy.set_replicas(r.replica_id.unique_id for r in replicas)
        for replica in replicas:
            tokens = (replica.routing_stats or {}).get(KV_CACHE_TOKENS)
            if isinstance(tokens, int):
                self._policy.set_kv_capacity(replica.replica_id.unique_id, tokens)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # Serve calls this as soon as a probe or a request sees the actor dead, before the
        # controller's next replica-set broadcast.
        super().on_replica_actor_died(replica_id)
        self._policy.remove_replica(replica_id.unique_id)
        departures.ENGINE_DEPARTURES.lost(replica_id.unique_id)

    async def _until_gone(self, replica: RunningReplica) -> None:
        """Probe a replica that left the set while calls of ours are on it: one that stops
        answering (dead, hung) is lost, which fails those calls over (``departures``)."""
        name = replica.replica_id.unique_id
        while departures.ENGINE_DEPARTURES.watching(name):
            try:
                probe = replica.get_queue_len(deadline_s=DEPARTED_PROBE_S)
                await asyncio.wait_for(probe, DEPARTED_PROBE_S)
            except Exception:  # Dead (ActorDiedError), unreachable, or no answer in time.
                departures.ENGINE_DEPARTURES.lost(name)
                return
            await asyncio.sleep(DEPARTED_PROBE_EVERY_S)

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Queue lengths from Serve's per-caller cache, probing the replicas it lacks."""
        cache = self.replica_queue_len_cache
        lens: dict[ReplicaID, int] = {}
        missing: list[RunningReplica] = []
        for replica in replicas:
            n = cache.get(replica.replica_id)
            if n is None:
                missing.append(replica)
            else:
                lens[replica.replica_id] = n
        if missing:
            # Serve's own prober (Ray's PrefixCacheAffinityRouter uses it too): in parallel,
            # short deadline, fills the cache, handles dead actors.
            for replica, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    lens[replica.replica_id] = n
        return lens

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without this Serve retries a round of full replicas in a tight loop.
            pending_request.routing_context.should_backoff = True
            target = target_replica(pending_request)
            if target is not None:  # An output channel: that replica or none.
                named = [r for r in candidate_replicas if r.replica_id.unique_id == target]
                return [named] if named else []
        if len(candidate_replicas) <= 1:
            # Nothing to choose: no queue probe, no policy work (on_request_routed still
            # records the blocks, for when a second replica joins).
            return [candidate_replicas] if candidate_replicas else []
        lens = await self._queue_lens(candidate_replicas)
        picked = self._picked()
        lens = {replica: n + picked[replica] for replica, n in lens.items()}
        # Replicas at max_ongoing_requests would reject; unreachable ones are skipped.
        open_ = [
            r
            for r in candidate_replicas
            if r.replica_id in lens and lens[r.replica_id] < r.max_ongoing_requests
        ]
        if not open_:
            return [candidate_replicas]  # All full or unknown: Serve probes them, backs off.
        by_name = {r.replica_id.unique_id: r for r in open_}
        keys = request_keys(pending_request)
        decision = self._policy.choose(
            keys.hashes,
            {r.replica_id.unique_id: lens[r.replica_id] for r in open_},
            list(by_name),
            session_key=keys.session,
            adapter=keys.adapter,
        )
        self._metrics.record(decision.reason, decision.replica)
        chosen = by_name[decision.replica]
        if pending_request is not None:
            self._picks[id(pending_request)] = (chosen.replica_id, time.monotonic())
        # Second rank, used only if `chosen` rejects (it filled up since our view of it): the
        # two least loaded others, as Serve's power of two choices would pick.
        rest = sorted((r for r in open_ if r is not chosen), key=lambda r: lens[r.replica_id])
        return [[chosen], rest[:2]] if rest else [[chosen]]

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: RequestMetadata | None = None
    ) -> None:
        # Serve hands the chosen replica to the pending request with the same
        # internal_request_id, which a handle call inherits from the HTTP request that made it:
        # the engine calls of one multi-prompt completion share one, so all but the first
        # were never handed a replica (they waited out engine_wait_timeout_s). Each call's
        # own metadata object is unique: match on it first.
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                if (
                    self._pending_requests_by_id.get(pending.metadata.internal_request_id)
                    is pending
                ):
                    self._remove_pending_request_from_indices(pending)  # Not a sibling's entry.
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def _picked(self) -> Counter[ReplicaID]:
        """Recent picks per replica that Serve's cache does not count yet."""
        now = time.monotonic()
        for key, (_, at) in list(self._picks.items()):
            if now - at > PICK_TTL_S:
                del self._picks[key]
        return Counter(replica for replica, _ in self._picks.values())

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # Serve's cache counts the request from here on: drop one pick of ours for it.
        super().on_send_request(replica_id)
        for key, (replica, _) in self._picks.items():
            if replica == replica_id:
                del self._picks[key]
                break

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._picks.pop(id(pending_request), None)
        if (request_id := engine_request_id(pending_request)) is not None:
            departures.ENGINE_DEPARTURES.routed(request_id, replica_id.unique_id)
        # Called once the replica accepted. choose() already recorded the blocks at its pick;
        # if Serve fell back to the second rank, record them where they really went.
        hashes = request_keys(pending_request).hashes
        name = replica_id.unique_id
        if hashes and not self._policy.index.holds(name, hashes[-1]):
            self._policy.record(name, hashes)
