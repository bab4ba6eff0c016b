"""Loading and unloading LoRA adapters at runtime: vLLM's routes and bodies, for the whole fleet.

``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` checks the adapter on one
engine replica (which keeps it loaded), then records it where every router replica reads it
(``serve_app.ingress.adapters``); ``POST /v1/unload_lora_adapter {lora_name}`` forgets it. When
the app serves several models, ``base_model_name`` says which one the adapter is for. Turned on
per model by ``model.max_runtime_adapters``; with API keys, only ``security.admin_keys`` may call.
Wiring: ``app.include_router(lora_admin.router)`` before ``@serve.ingress``, and ``attach``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from serve_app.config.model import ADAPTER_NAME
from serve_app.config.security import SecurityConfig
from serve_app.errors import APIError, ErrorInfo, model_not_found
from serve_app.hops import LoraAdapter
from serve_app.ingress.backends import ModelBackend, ModelBackends
from serve_app.ingress.tenancy import tenant_of
from serve_app.openai.protocol import ErrorResponse

router = APIRouter(
    responses={code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 503)}
)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body, plus ``base_model_name`` for apps that serve several models."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here.


class AdapterAdmin:
    def __init__(self, backends: ModelBackends, security: SecurityConfig) -> None:
        self._backends = backends
        self._runtime = backends.runtime
        self._admins = set(security.admin_keys)

    def check_admin(self, tenant: str) -> None:
        """Without keys every caller is "" (open); with keys, only the admin key names."""
        if tenant and tenant not in self._admins:
            raise APIError(
                f"The API key {tenant!r} may not load or unload adapters; an operator lists "
                "admin key names in security.admin_keys.",
                status=403,
                type="permission_error",
                code="permission_denied",
            )

    async def load(self, body: LoadLoRAAdapterRequest, tenant: str) -> str:
        self.check_admin(tenant)
        backend = self._model_of(body.base_model_name)
        name, limit = body.lora_name, backend.config.model.max_runtime_adapters
        if limit == 0:
            raise APIError(
                f"Runtime LoRA loading is off for {backend.name!r}; an operator turns it on "
                "with model.max_runtime_adapters.",
                param="base_model_name",
                code="runtime_lora_off",
            )
        if not ADAPTER_NAME.fullmatch(name):
            raise APIError(
                f"lora_name {name!r}: use 1-128 letters, digits and . _ - : / (clients put it "
                "in `model`).",
                param="lora_name",
            )
        if name in {n for b in self._backends for n in b.servings}:
            raise APIError(
                f"The lora adapter {name!r} conflicts with a served model or configured adapter.",
                param="lora_name",
            )
        assert self._runtime is not None  # Some model has max_runtime_adapters > 0.
        await self._backends.fresh()
        loaded = self._runtime.get(name)
        if loaded is not None and not body.load_inplace:
            raise _already_loaded(name)
        if loaded is None and await asyncio.to_thread(self._runtime.count, backend.name) >= limit:
            raise _too_many(backend.name, limit)
        # A reload in place gets a new revision: engines load it afresh, not from their cache.
        adapter = LoraAdapter(name, body.lora_path, time.time_ns() if body.load_inplace else 0)
        error: ErrorInfo | None = await backend.bounded(backend.engine.add_lora.remote(adapter))
        if error is not None:
            raise APIError.from_info(error)
        added = await asyncio.to_thread(
            self._runtime.add, backend.name, adapter, replace=body.load_inplace, limit=limit
        )
        if added == "taken":  # Another router loaded the same name meanwhile.
            raise _already_loaded(name)
        if added == "full":  # Others loaded up to the limit meanwhile.
            raise _too_many(backend.name, limit)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest, tenant: str) -> str:
        self.check_admin(tenant)
        name = body.lora_name
        if any(name in b.config.model.lora_adapters for b in self._backends):
            raise APIError(
                f"The lora adapter {name!r} comes from the config (model.lora_adapters); "
                "remove it there.",
                param="lora_name",
            )
        await self._backends.fresh()
        runtime = self._runtime
        if runtime is None or not await asyncio.to_thread(runtime.remove, name):
            raise APIError(
                f"The lora adapter '{name}' cannot be found.",
                status=404,
                param="lora_name",
                code="lora_adapter_not_found",
            )
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _model_of(self, base_model_name: str | None) -> ModelBackend:
        backends = list(self._backends)
        if base_model_name is None:
            if len(backends) > 1:
                raise APIError(
                    "This app serves several models: say which one the adapter is for in "
                    f"base_model_name ({', '.join(b.name for b in backends)}).",
                    param="base_model_name",
                )
            return backends[0]
        for backend in backends:
            if backend.name == base_model_name:
                return backend
        raise model_not_found(base_model_name, [b.name for b in backends])


def _too_many(model: str, limit: int) -> APIError:
    return APIError(
        f"{model!r} has {limit} runtime adapters, its limit (model.max_runtime_adapters); "
        "unload one first.",
        param="lora_name",
        code="too_many_adapters",
    )


def _already_loaded(name: str) -> APIError:
    return APIError(
        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
        "in place, set 'load_inplace' to True.",
        param="lora_name",
    )


_admin: AdapterAdmin | None = None


def attach(backends: ModelBackends, security: SecurityConfig) -> None:
    """Called by the router replica with its model backends."""
    global _admin
    _admin = AdapterAdmin(backends, security)


def _attached() -> AdapterAdmin:
    if _admin is None:
        raise APIError("The router is starting.", status=503, code="backend_unavailable")
    return _admin


# vLLM's success answer is text; errors stay JSON (a route-wide response_class would say text).
_TEXT: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Done."}
}


@router.post("/v1/load_lora_adapter", responses=_TEXT)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a LoRA adapter at runtime; every router replica serves it within a second."""
    return PlainTextResponse(await _attached().load(body, tenant_of(request)))


@router.post("/v1/unload_lora_adapter", responses=_TEXT)
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    """Forget a runtime adapter: its name is a 404 on every router replica within a second."""
    return PlainTextResponse(await _attached().unload(body, tenant_of(request)))
