"""LoRA adapters loaded at runtime, as every router replica of an application sees them.

They live in Ray's GCS key-value store (one key per adapter: ``lora/<app>/<model>/<name>`` in
namespace ``serve_app``), not in a replica: a load through one router is served by all of them
within ``REFRESH_S``, and router or engine replicas that are replaced keep serving it (engines
load an adapter on its first request). Creating a key is atomic, so two concurrent loads of one
name cannot both win. The store calls block, so they run in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from serve_app.hops import LoraAdapter

NAMESPACE = "serve_app"
REFRESH_S = 1.0  # How stale a router's view of other routers' loads and unloads may get.
AddResult = Literal["added", "taken", "full"]


class KeyValueStore(Protocol):
    def keys(self, prefix: bytes) -> list[bytes]: ...

    def get(self, key: bytes) -> bytes | None: ...

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """The values of those ``keys`` that exist, in one round trip."""
        ...

    def create(self, key: bytes, value: bytes, *, replace: bool) -> bool:
        """Store ``value``; False when the key exists and ``replace`` is off (nothing stored)."""
        ...

    def delete(self, key: bytes) -> bool:
        """True when the key existed."""
        ...


class GcsStore:
    """Ray's GCS key-value store, which Serve keeps its own checkpoints in."""

    def keys(self, prefix: bytes) -> list[bytes]:
        from ray.experimental import internal_kv

        return list(internal_kv._internal_kv_list(prefix, namespace=NAMESPACE))

    def get(self, key: bytes) -> bytes | None:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        return bytes(value) if value is not None else None

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        from ray.experimental import internal_kv

        client = internal_kv.internal_kv_get_gcs_client()
        found = client.internal_kv_multi_get(keys, namespace=NAMESPACE.encode())
        return {bytes(key): bytes(value) for key, value in found.items() if value is not None}

    def create(self, key: bytes, value: bytes, *, replace: bool) -> bool:
        from ray.experimental import internal_kv

        existed = internal_kv._internal_kv_put(key, value, replace, namespace=NAMESPACE)
        return replace or not existed

    def delete(self, key: bytes) -> bool:
        from ray.experimental import internal_kv

        return bool(internal_kv._internal_kv_del(key, namespace=NAMESPACE))


class MemoryStore:
    """One process's stand-in (unit tests, and routers outside Ray)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def keys(self, prefix: bytes) -> list[bytes]:
        return [key for key in self.data if key.startswith(prefix)]

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        return {key: self.data[key] for key in keys if key in self.data}

    def create(self, key: bytes, value: bytes, *, replace: bool) -> bool:
        if key in self.data and not replace:
            return False
        self.data[key] = value
        return True

    def delete(self, key: bytes) -> bool:
        return self.data.pop(key, None) is not None


@dataclass(frozen=True)
class RuntimeAdapter:
    model: str  # The served name of the model it adapts.
    adapter: LoraAdapter


class RuntimeAdapters:
    """The adapters loaded at runtime into one application, by name, refreshed from the store."""

    def __init__(self, store: KeyValueStore, app_name: str, models: list[str]) -> None:
        self._store = store
        self._app = app_name
        self._models = models
        self._by_name: dict[str, RuntimeAdapter] = {}
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None
        self._changes = 0  # Local adds and removes: a read that overlapped one is dropped.

    def _prefix(self, model: str) -> bytes:
        return f"lora/{self._app}/{model}/".encode()

    def get(self, name: str) -> RuntimeAdapter | None:
        return self._by_name.get(name)

    def count(self, model: str) -> int:
        return len(self._store.keys(self._prefix(model)))

    def of(self, model: str) -> list[LoraAdapter]:
        return [r.adapter for r in self._by_name.values() if r.model == model]

    async def fresh(self) -> None:
        """Re-read the store when this view is older than REFRESH_S (one read at a time)."""
        if time.monotonic() - self._refreshed_at < REFRESH_S:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(asyncio.to_thread(self._refresh))
        await asyncio.shield(self._refreshing)

    def _refresh(self) -> None:
        changes = self._changes
        seen: dict[str, RuntimeAdapter] = {}
        for model in self._models:
            prefix = self._prefix(model)
            # Values too, not only names: a reload in place through another router changes
            # the revision under the same name.
            for key, value in self._store.get_many(self._store.keys(prefix)).items():
                name = key[len(prefix) :].decode()
                seen[name] = RuntimeAdapter(model, LoraAdapter(name, **json.loads(value)))
        if changes == self._changes:
            self._by_name = seen
            self._refreshed_at = time.monotonic()

    def add(self, model: str, adapter: LoraAdapter, *, replace: bool, limit: int) -> AddResult:
        """Record ``adapter`` (blocking). "taken": the name is loaded and not ``replace``;
        "full": the model already has ``limit`` runtime adapters (nothing recorded)."""
        value = json.dumps({"path": adapter.path, "revision": adapter.revision}).encode()
        key = self._prefix(model) + adapter.name.encode()
        if not self._store.create(key, value, replace=replace):
            return "taken"
        # Counted after creating: two routers loading different names at the limit cannot
        # both pass a count taken before (both may back out; a retry then wins).
        if not replace and len(self._store.keys(self._prefix(model))) > limit:
            self._store.delete(key)
            return "full"
        self._changes += 1
        self._by_name[adapter.name] = RuntimeAdapter(model, adapter)
        return "added"

    def remove(self, name: str) -> bool:
        """Forget ``name`` (blocking); False when it is not loaded at runtime."""
        self._changes += 1
        known = self._by_name.pop(name, None)
        models = [known.model] if known else self._models
        removed = [self._store.delete(self._prefix(m) + name.encode()) for m in models]
        return any(removed)
