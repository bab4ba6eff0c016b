"""The routing decision, in plain Python: longest cached prefix first, spill past a margin;
a LoRA adapter's requests to the replicas that already hold it.

One ``RoutingPolicy`` lives in each process that calls the engine (each Router replica) and
remembers what that process sent where. The Serve adapter (``serve_router``), the simulator
(``loadtest.routing_sim``) and the unit tests all drive ``choose``.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Literal

from serve_app.config.routing import RoutingConfig
from serve_app.engine.routing.index import PrefixIndex

Reason = Literal["affinity", "spill", "session", "adapter", "balance"]
REASONS: tuple[Reason, ...] = ("affinity", "spill", "session", "adapter", "balance")
# Index size per replica until the replica reports its KV cache size.
DEFAULT_INDEX_BLOCKS = 4096
# What an engine replica reports through Serve's record_routing_stats: its KV cache in tokens.
KV_CACHE_TOKENS = "kv_cache_tokens"
# least_loaded: a new prefix avoids replicas whose index is fuller than the emptiest one's by
# this share of its capacity.
FILL_SLACK = 0.1
_M64 = (1 << 64) - 1


def stable_key(value: str) -> int:
    """The same 64-bit int for a session key or replica id in every process."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little")


def hrw_score(key: int, replica_key: int) -> int:
    """Rendezvous weight: murmur3's 64-bit finaliser of ``key ^ replica_key``.

    Plain ints, so every process computes the same weight; Python's tuple hash() is
    deterministic but too uneven for this (8 replicas got 28 to 100 of 400 keys).
    """
    x = (key ^ replica_key) & _M64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _M64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: Reason
    matched_blocks: int = 0


class RoutingPolicy:
    """Prefers the replica holding the longest prefix; spills when it is too far behind.

    ``queue_lens`` are requests in flight per replica as this caller sees them. A replica
    is "within the margin" when its queue is at most
    ``min_queue + max(spill_margin, spill_ratio * min_queue)``.

    A LoRA adapter's request that no cached prefix places goes to the adapter's rendezvous
    order: its first replica while that is within the margin, else the next. Every caller
    computes the same order, so an adapter lives on as few replicas as its load needs (each
    load costs a replica a read from disk and one of its ``max_loras`` slots) with no state
    shared between callers.
    """

    def __init__(self, config: RoutingConfig, seed: int | None = None) -> None:
        self.config = config
        self.index = PrefixIndex(config.index_blocks_per_replica or DEFAULT_INDEX_BLOCKS)
        self.counts: Counter[Reason] = Counter()
        self._replica_key: dict[str, int] = {}
        self._rng = random.Random(seed)

    # ---- membership ---------------------------------------------------------------------
    def set_replicas(self, replicas: Iterable[str]) -> None:
        """Sync with the current replica set: joiners start cold, leavers are forgotten."""
        new = set(replicas)
        for replica in set(self._replica_key) - new:
            self.remove_replica(replica)
        for replica in new - set(self._replica_key):
            self._add(replica)

    def remove_replica(self, replica: str) -> None:
        self._replica_key.pop(replica, None)
        self.index.remove_replica(replica)

    def set_kv_capacity(self, replica: str, kv_cache_tokens: int) -> None:
        """The replica reported its KV cache size: size its index to match (unless fixed)."""
        if self.config.index_blocks_per_replica is None and kv_cache_tokens > 0:
            self.index.set_capacity(replica, kv_cache_tokens // self.config.block_size)

    def _add(self, replica: str) -> None:
        self._replica_key[replica] = stable_key(replica)
        self.index.add_replica(replica)

    # ---- decision -----------------------------------------------------------------------
    def choose(
        self,
        hashes: Sequence[int],
        queue_lens: Mapping[str, int],
        candidates: Sequence[str] | None = None,
        session_key: str | None = None,
        adapter: str | None = None,
    ) -> Decision:
        """Pick a replica among ``candidates`` (default: all known) for one request and
        remember that it will hold ``hashes``. ``adapter``: the LoRA adapter's name, if any."""
        cands = list(self._replica_key) if candidates is None else list(candidates)
        if not cands:
            raise ValueError("no candidate replicas")
        allowed = set(cands)
        for replica in allowed - self._replica_key.keys():  # Known to the caller before us.
            self._add(replica)
        lens = list(map(queue_lens.get, cands, repeat(0)))
        least = min(lens)
        limit = least + max(self.config.spill_margin, self.config.spill_ratio * least)
        decision = self._decide(
            hashes, queue_lens, cands, lens, allowed, least, limit, session_key, adapter
        )
        self.counts[decision.reason] += 1
        self.record(decision.replica, hashes)
        return decision

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        """Note that ``replica`` now computes and caches ``hashes``."""
        if hashes and self.config.policy == "prefix_aware":
            self.index.insert(replica, hashes)

    def _decide(
        self,
        hashes: Sequence[int],
        queue_lens: Mapping[str, int],
        cands: list[str],
        lens: list[int],
        allowed: set[str],
        least: int,
        limit: float,
        session_key: str | None,
        adapter: str | None,
    ) -> Decision:
        replica_key = self._replica_key

        def queue(replica: str) -> int:
            return queue_lens.get(replica, 0)

        if session_key:
            key = stable_key(session_key)
            home = max(cands, key=lambda r: hrw_score(key, replica_key[r]))
            if queue(home) <= limit:
                return Decision(home, "session")
            # Overloaded: fall through; the session goes home once the load evens out.
        prefix_aware = bool(hashes) and self.config.policy == "prefix_aware"
        if prefix_aware:
            depth, holders = self.index.longest_match(hashes, allowed)
            first = hashes[0]
            if depth:
                best = min(holders, key=lambda r: (queue(r), -hrw_score(first, replica_key[r])))
                if queue(best) <= limit:
                    return Decision(best, "affinity", depth)
                # Warm spill: a replica within the margin holding a shorter prefix (e.g. the
                # shared system prompt) still saves most of the prefill.
                warm = [r for r in self.index.owners(first) & allowed if queue(r) <= limit]
                if warm:
                    depths = {r: self.index.match_depth(r, hashes) for r in warm}
                    target = max(
                        warm,
                        key=lambda r: (depths[r], -queue(r), hrw_score(first, replica_key[r])),
                    )
                    return Decision(target, "spill", depths[target])
        if adapter:
            # The adapter's rendezvous order, first replica within the margin: where its other
            # requests went, so it is loaded there already.
            key = stable_key(f"lora:{adapter}")
            pool = [r for r, n in zip(cands, lens, strict=True) if n <= limit]
            return Decision(max(pool, key=lambda r: hrw_score(key, replica_key[r])), "adapter")
        if not prefix_aware:
            idle = [r for r, n in zip(cands, lens, strict=True) if n == least]
            return Decision(self._rng.choice(idle), "balance")
        # A cold prefix, or nothing warm within the margin. Ties (e.g. every queue empty) go
        # by a rendezvous hash of the first block, so independent callers (and a restarted
        # one) put a new prefix on the same replica.
        if self.config.cold_placement == "hrw":
            pool = [r for r, n in zip(cands, lens, strict=True) if n <= limit]
        else:
            pool = [r for r, n in zip(cands, lens, strict=True) if n == least]
            # Fill caches evenly: skip replicas whose index is clearly fuller than the
            # emptiest one's (one caller sees all it sent; several would disagree on fills).
            emptiest = min(map(self.index.fill, pool))
            pool = [r for r in pool if self.index.fill(r) <= emptiest + FILL_SLACK]
        target = max(pool, key=lambda r: hrw_score(first, replica_key[r]))
        return Decision(target, "spill" if depth else "balance")
