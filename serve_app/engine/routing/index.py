"""Which block hashes each replica probably holds: one bounded LRU per replica + owners map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence


class PrefixIndex:
    """What this caller sent where, forgotten in LRU order as the engine would evict it.

    Each replica's LRU holds at most its capacity in blocks (about its KV cache); a reverse map
    finds the replicas holding a hash without scanning every replica.
    """

    def __init__(self, default_capacity: int) -> None:
        self.default_capacity = default_capacity
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self._owners: dict[int, set[str]] = {}

    def replicas(self) -> list[str]:
        return list(self._lru)

    def add_replica(self, replica: str) -> None:
        if replica not in self._lru:
            self._lru[replica] = OrderedDict()
            self._capacity[replica] = self.default_capacity

    def remove_replica(self, replica: str) -> None:
        self._capacity.pop(replica, None)
        for h in self._lru.pop(replica, ()):
            self._drop_owner(h, replica)

    def set_capacity(self, replica: str, blocks: int) -> None:
        if replica in self._lru:
            self._capacity[replica] = max(1, blocks)
            self._trim(replica)

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, 0)

    def fill(self, replica: str) -> float:
        """How full this replica's index is, 0 to 1 (0 for an unknown replica)."""
        return len(self._lru.get(replica, ())) / max(1, self._capacity.get(replica, 1))

    def size(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def holds(self, replica: str, h: int) -> bool:
        return h in self._lru.get(replica, ())

    def insert(self, replica: str, hashes: Sequence[int]) -> None:
        lru = self._lru.get(replica)
        if lru is None:  # A departed replica: do not resurrect it.
            return
        owners = self._owners
        # Deepest block first, so block 0 ends most recent: like vLLM (which frees a request's
        # tail blocks first), eviction then trims prefixes from their tails.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders = owners.get(h)
                if holders is None:
                    owners[h] = {replica}
                else:
                    holders.add(replica)
        self._trim(replica)

    def owners(self, h: int) -> set[str]:
        return self._owners.get(h, set())

    def match_depth(self, replica: str, hashes: Sequence[int]) -> int:
        """Blocks of ``hashes`` this replica holds (binary search: the prefixes are nested)."""
        lru: Mapping[int, None] = self._lru.get(replica, {})
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def longest_match(self, hashes: Sequence[int], allowed: set[str]) -> tuple[int, set[str]]:
        """(depth, replicas in ``allowed`` holding that depth) of the deepest match."""
        lo, hi, best = 0, len(hashes), set[str]()
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self._owners.get(hashes[mid - 1], set()) & allowed
            if found:
                lo, best = mid, found
            else:
                hi = mid - 1
        return lo, best

    def _trim(self, replica: str) -> None:
        lru, limit = self._lru[replica], self._capacity[replica]
        while len(lru) > limit:
            self._drop_owner(lru.popitem(last=False)[0], replica)

    def _drop_owner(self, h: int, replica: str) -> None:
        holders = self._owners.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._owners[h]
