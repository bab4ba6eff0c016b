"""Which LoRA adapters exist, the same for every router replica.

Adapters from the config are known to every replica; adapters loaded (or config ones unloaded)
at runtime live in one named Ray actor per application (``serve_app_adapters.<app>`` in
namespace ``serve_app``), like the rate limiter. Each router replica reads it at most once per
``ttl_s`` (on demand: only requests that name an adapter or an unknown model wait for it) and
changes it with atomic calls, so a load or unload on one replica holds on all of them within
``ttl_s``. The actor is owned by the replica that created it; should that replica go away, the
next replica to call re-creates it and seeds it with the newest state it has seen (a mutation
younger than one ``ttl_s`` can be lost with the owner: the only window).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.hops import AdapterRef
from serve_app.openai.dispatch import AdapterEntry

logger = logging.getLogger("serve_app.graph.adapters")
NAMESPACE = "serve_app"
REGISTRY_NAME = "serve_app_adapters"
# name -> entry fields, or None: a config adapter unloaded at runtime.
Entries = dict[str, dict[str, Any] | None]


class AdapterTable:
    """The runtime state (plain Python: the actor's body, and the unit tests' backend)."""

    def __init__(self) -> None:
        self.version = 0  # Bumped by every change: a re-created actor takes the newest seed.
        self.generations = 0
        self.entries: Entries = {}

    def snapshot(self) -> tuple[int, Entries]:
        return self.version, dict(self.entries)

    def next_generation(self) -> int:
        # Milliseconds, so a re-created table never hands out a generation engines still hold.
        self.generations = max(self.generations + 1, time.time_ns() // 1_000_000)
        return self.generations

    def register(self, entry: dict[str, Any], inplace: bool, limit: int) -> str | None:
        """Add or replace (``inplace``) a runtime adapter; the error, or None."""
        name = entry["name"]
        if self.entries.get(name) is not None and not inplace:
            return "exists"
        same_base = [e for e in self.entries.values() if e and e["base"] == entry["base"]]
        if name not in self.entries and len(same_base) >= limit:
            return "full"
        self.entries[name] = entry
        self.generations = max(self.generations, entry["generation"])
        self.version += 1
        return None

    def unregister(self, name: str, from_config: bool) -> bool:
        """Remove an adapter; a config one leaves a tombstone. False: there was none."""
        if name in self.entries:
            if self.entries[name] is None:
                return False
            if from_config:
                self.entries[name] = None
            else:
                del self.entries[name]
        elif from_config:
            self.entries[name] = None
        else:
            return False
        self.version += 1
        return True

    def restore(self, version: int, entries: Entries, generations: int) -> None:
        """Seed a re-created table with a replica's newer view."""
        if version > self.version:
            self.version, self.entries = version, dict(entries)
            self.generations = max(self.generations, generations)


class TableBackend(Protocol):
    async def call(self, method: str, *args: Any) -> Any: ...


class LocalTable:
    """In-process backend (one router replica, unit tests)."""

    def __init__(self, table: AdapterTable | None = None) -> None:
        self.table = table or AdapterTable()

    async def call(self, method: str, *args: Any) -> Any:
        return getattr(self.table, method)(*args)


class RayTable:
    """The shared named actor; re-created (and re-seeded by the caller) if its owner died."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self._timeout_s = name, timeout_s
        self._actor: Any = None

    async def call(self, method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import RayActorError

        for attempt in range(3):
            if self._actor is None:
                self._actor = (
                    ray.remote(AdapterTable)
                    .options(
                        name=self.name,
                        namespace=NAMESPACE,
                        get_if_exists=True,
                        num_cpus=0,
                        max_concurrency=1,  # One call at a time: every method is atomic.
                    )
                    .remote()
                )
            try:
                ref = getattr(self._actor, method).remote(*args)
                return await asyncio.wait_for(ref, self._timeout_s)
            except RayActorError:
                self._actor = None
                await asyncio.sleep(0.1 * (attempt + 1))
        raise RuntimeError(f"adapter registry actor {self.name} is unavailable")


def _unavailable(exc: BaseException) -> APIError:
    return APIError(
        f"The adapter registry is unavailable ({exc!r}); retry shortly.",
        status=503,
        type="server_error",
        code="backend_unavailable",
    )


class AdapterRegistry:
    """The adapters of the app as this router replica sees them (an ``AdapterDirectory``)."""

    def __init__(
        self,
        config: AppConfig,
        backend: TableBackend,
        *,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend, self._ttl_s, self._clock = backend, ttl_s, clock
        now = int(time.time())
        self.configured = {
            name: AdapterEntry(AdapterRef(name, source), block.model.public_name, now)
            for block in config.models
            for name, source in block.lora.adapters.items()
        }
        self.limits = {b.model.public_name: b.lora.max_runtime_adapters for b in config.models}
        self._version, self._entries, self._generations = 0, dict[str, Any](), 0
        self._view = dict(self.configured)
        self._fetched_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None

    async def lookup(self, name: str) -> AdapterEntry | None:
        await self._fresh()
        return self._view.get(name)

    async def entries(self) -> list[AdapterEntry]:
        await self._fresh()
        return [self._view[name] for name in sorted(self._view)]

    def runtime_count(self, base: str) -> int:
        return sum(1 for e in self._entries.values() if e and e["base"] == base)

    async def next_generation(self) -> int:
        return int(await self._call("next_generation"))

    async def register(self, entry: AdapterEntry, inplace: bool) -> str | None:
        """``exists`` / ``full`` / None (registered); every replica sees it within ttl_s."""
        fields = {"name": entry.name, "base": entry.base, "created": entry.created}
        fields |= {"source": entry.ref.source, "generation": entry.ref.generation}
        error = await self._call("register", fields, inplace, self.limits[entry.base])
        await self._fresh(force=True)
        return str(error) if error else None

    async def unregister(self, name: str) -> bool:
        found = bool(await self._call("unregister", name, name in self.configured))
        await self._fresh(force=True)
        return found

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await self._backend.call(method, *args)
        except APIError:
            raise
        except Exception as exc:
            raise _unavailable(exc) from exc

    async def _fresh(self, force: bool = False) -> None:
        if not force and self._clock() - self._fetched_at < self._ttl_s:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._update())
        await asyncio.shield(self._refresh)

    async def _update(self) -> None:
        try:
            version, entries = await self._backend.call("snapshot")
            if version < self._version:  # A re-created registry: seed it with what we saw.
                await self._backend.call("restore", self._version, self._entries, self._generations)
                version, entries = await self._backend.call("snapshot")
        except Exception as exc:  # Serve from the last view; changes fail with 503 meanwhile.
            logger.warning("Adapter registry unreachable (%r); using the last view", exc)
        else:
            self._apply(version, entries)
        self._fetched_at = self._clock()

    def _apply(self, version: int, entries: Entries) -> None:
        self._version, self._entries = version, entries
        generations = [e["generation"] for e in entries.values() if e]
        self._generations = max([self._generations, *generations])
        view = {n: e for n, e in self.configured.items() if n not in entries}
        for name, e in entries.items():
            if e is not None:
                ref = AdapterRef(name, e["source"], e["generation"])
                view[name] = AdapterEntry(ref, e["base"], e["created"])
        self._view = view
