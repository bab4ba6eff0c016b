"""The LoRA adapters one engine replica has loaded into vLLM.

An adapter is loaded on its first request (or an explicit load) with ``AsyncLLM.add_lora``
before any request names it: a request whose adapter cannot be loaded would otherwise kill the
engine core, while a failed ``add_lora`` only raises. Loads of one name never overlap (vLLM
does not guard against two concurrent loads of the same adapter). Each load gets a fresh vLLM
int id, and the name vLLM sees carries the generation (``name@3``): vLLM neither reloads an id
it already holds nor separates prefix-cache blocks of two loads from one path. vLLM keeps
``max_cpu_loras`` adapters in an LRU in CPU memory and ``max_loras`` of them in the engine's
slots per step, reloading evicted ones from their source on use; this class remembers a
bounded number of loads and removes the older generations of a reloaded name.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from serve_app.errors import APIError
from serve_app.hops import AdapterRef

logger = logging.getLogger("serve_app.engine")


def adapter_load_error(ref: AdapterRef, exc: BaseException) -> APIError:
    """What a failed load tells the client: 404 when nothing is at the source (as vLLM's
    /v1/load_lora_adapter), 503 when the engine died meanwhile, else 400 with vLLM's reason."""
    text = str(exc)
    if "No adapter found" in text or isinstance(exc, FileNotFoundError):
        return APIError(
            f"LoRA adapter '{ref.name}' could not be loaded: no adapter found at {ref.source}.",
            status=404,
            param="lora_path",
            code="adapter_not_found",
        )
    if type(exc).__name__ == "EngineDeadError":
        return APIError(
            f"The engine died ({text}); the replica is being replaced, retry shortly.",
            status=503,
            type="server_error",
            code="engine_unavailable",
        )
    return APIError(
        f"LoRA adapter '{ref.name}' from {ref.source} could not be loaded: {text}",
        param="lora_path",
        code="invalid_adapter",
    )


class EngineAdapters:
    """(name, generation) -> vLLM ``LoRARequest``, loaded once, under a per-name lock."""

    def __init__(
        self,
        add: Callable[[Any], Awaitable[Any]],
        remove: Callable[[int], Awaitable[Any]],
        capacity: int = 64,
    ) -> None:
        """``add``/``remove``: the engine's ``add_lora`` / ``remove_lora``; ``capacity``: loads
        remembered (older ones are removed from vLLM too)."""
        self._add, self._remove, self._capacity = add, remove, capacity
        self._ids = itertools.count(1)
        self._loaded: OrderedDict[str, Any] = OrderedDict()  # AdapterRef.key -> LoRARequest
        self._newest: dict[str, int] = {}  # name -> highest generation loaded
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # name -> (lock, users)
        self.loads = 0  # add_lora calls that succeeded (tests, logs)

    def loaded(self) -> list[str]:
        """Keys (``name@generation``) of the loads remembered, least recently used first."""
        return list(self._loaded)

    async def request_for(self, ref: AdapterRef) -> Any:
        """The ``LoRARequest`` to pass to ``generate``; loads the adapter first if needed.
        Raises ``APIError`` (404/400/503) when it cannot be loaded; the engine is unharmed."""
        request = self._hit(ref)
        if request is not None:
            return request
        lock, users = self._locks.get(ref.name) or (asyncio.Lock(), 0)
        self._locks[ref.name] = (lock, users + 1)
        try:
            async with lock:
                request = self._hit(ref)
                if request is None:
                    request = await self._load(ref)
        finally:
            lock, users = self._locks[ref.name]
            if users == 1:
                del self._locks[ref.name]  # Bounded: a lock lives while someone waits on it.
            else:
                self._locks[ref.name] = (lock, users - 1)
        return request

    def _hit(self, ref: AdapterRef) -> Any:
        request = self._loaded.get(ref.key)
        if request is None or request.lora_path != ref.source:
            return None
        source = Path(ref.source)
        if source.is_absolute() and not source.exists():
            # vLLM reloads an evicted adapter from its source, and an unloadable one kills the
            # engine core: refuse here once the files are gone.
            raise adapter_load_error(ref, FileNotFoundError(ref.source))
        self._loaded.move_to_end(ref.key)
        return request

    async def _load(self, ref: AdapterRef) -> Any:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=ref.key, lora_int_id=next(self._ids), lora_path=ref.source)
        try:
            await self._add(request)
        except Exception as exc:
            logger.warning("Loading LoRA adapter %s from %s failed: %s", ref.key, ref.source, exc)
            raise adapter_load_error(ref, exc) from exc
        self.loads += 1
        logger.info("Loaded LoRA adapter %s from %s", ref.key, ref.source)
        self._loaded[ref.key] = request
        newest = self._newest.get(ref.name, -1)
        if ref.generation > newest:
            self._newest[ref.name] = ref.generation
            stale = [k for k in self._loaded if k.rpartition("@")[0] == ref.name and k != ref.key]
            for key in stale:  # A reload replaced these weights: free their slots.
                await self._forget(key)
        while len(self._loaded) > self._capacity:
            await self._forget(next(iter(self._loaded)))
        return request

    async def _forget(self, key: str) -> None:
        request = self._loaded.pop(key, None)
        if request is None:  # Another load (of another name) forgot it meanwhile.
            return
        name = key.rpartition("@")[0]
        if not any(k.rpartition("@")[0] == name for k in self._loaded):
            self._newest.pop(name, None)
        try:
            await self._remove(request.lora_int_id)
        except Exception:  # Only memory is at stake: vLLM's own LRU drops it eventually.
            logger.warning("Removing LoRA adapter %s failed", key, exc_info=True)
