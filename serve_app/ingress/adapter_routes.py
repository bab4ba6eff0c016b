"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's bodies and answers.

A load is checked (names, source, the model it runs on), then loaded into one engine replica of
that model — the one its traffic will go to — which proves the adapter loads before anyone can
name it, and only then registered for every router replica. An unload removes the name
everywhere (404 from then on); engine replicas drop the weights from their LRU in time. Both need
an admin key (``security.admin_keys``) when API keys are configured.

Wiring: ``app.include_router(adapter_routes.router)`` before ``@serve.ingress`` and
``adapter_routes.attach(AdapterAdmin(...))`` in the router's ``__init__``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from serve_app.config import AppConfig
from serve_app.config.lora import ADAPTER_NAME_RE, check_adapter_source
from serve_app.errors import APIError, ErrorInfo
from serve_app.graph.adapter_registry import AdapterRegistry
from serve_app.hops import AdapterRef
from serve_app.openai.dispatch import AdapterEntry
from serve_app.openai.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

# Loads an adapter into one engine replica of a model: None, or the error for the client.
Loader = Callable[[AdapterRef], Awaitable[ErrorInfo | None]]

# The routes answer text/plain (as vLLM's) and their errors JSON: the error bodies are
# documented by hand, since FastAPI would give them the route's text/plain media type.
_ERROR_BODY = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
router = APIRouter(
    responses={
        code: {"description": "OpenAI-style error", "content": _ERROR_BODY}
        for code in (400, 401, 403, 404, 408, 413, 429, 431, 500, 503, 504)
    }
)


def _bad(message: str, param: str = "lora_name", status: int = 400) -> APIError:
    return APIError(message, status=status, param=param, code="invalid_value")


class AdapterAdmin:
    """The two verbs, without HTTP (unit tests drive it with fakes)."""

    def __init__(
        self,
        config: AppConfig,
        registry: AdapterRegistry,
        loaders: Mapping[str, Loader],
        keys_configured: Callable[[], bool],
    ) -> None:
        self.config, self.registry, self.loaders = config, registry, loaders
        self._keys_configured = keys_configured
        self._lock = asyncio.Lock()  # Changes from this replica, one at a time (they are rare).
        self.runtime_models = [
            block.model.public_name for block in config.models if block.lora.runtime_loading
        ]
        self.base_models = {block.model.public_name for block in config.models}

    def check_admin(self, key_name: str | None) -> None:
        admins = self.config.security.admin_keys
        if not self._keys_configured():
            if not admins:
                return  # No keys and no admins named: an open, local server.
            # Admins named but no keys loaded (SERVE_APP_API_KEYS unset, no keys file):
            # a deployment that forgot its secret must not open the routes to everyone.
            raise APIError(
                f"security.admin_keys names {', '.join(admins)} but no API keys are configured "
                "on this router (SERVE_APP_API_KEYS or security.api_keys_file); adapters "
                "cannot be changed until they are.",
                status=403,
                type="permission_error",
                code="admin_key_required",
            )
        if key_name in admins:
            return
        raise APIError(
            f"Key `{key_name}` may not load or unload adapters; use a key named in "
            "security.admin_keys.",
            status=403,
            type="permission_error",
            code="admin_key_required",
        )

    def _base_for(self, body: LoadLoRAAdapterRequest) -> str:
        base = body.base_model_name
        if base is None:
            if len(self.runtime_models) == 1:
                return self.runtime_models[0]
            if not self.runtime_models:
                raise _bad(
                    "Runtime LoRA loading is off: set lora.runtime_loading: true on a model.",
                    param="lora_path",
                )
            raise _bad(
                f"Several models load adapters at runtime ({', '.join(self.runtime_models)}); "
                "name one in base_model_name.",
                param="base_model_name",
            )
        if base not in self.base_models:
            raise _bad(f"No model `{base}` is served.", param="base_model_name", status=404)
        if base not in self.runtime_models:
            raise _bad(
                f"Runtime LoRA loading is off for `{base}`: set lora.runtime_loading: true.",
                param="base_model_name",
            )
        return base

    async def load(self, body: LoadLoRAAdapterRequest, key_name: str | None) -> str:
        self.check_admin(key_name)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise _bad("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.base_models:
            raise _bad(f"The lora adapter '{name}' conflicts with a served base model.")
        if not ADAPTER_NAME_RE.fullmatch(name):
            raise _bad(f"'{name[:64]}': adapter names are 1-128 characters without spaces.")
        try:
            check_adapter_source(path)
        except ValueError as exc:
            raise _bad(str(exc), param="lora_path") from None
        base = self._base_for(body)
        async with self._lock:
            known = await self.registry.lookup(name)
            if known is not None and not body.load_inplace:
                raise _already(name)
            if known is None and self.registry.runtime_count(base) >= self.registry.limits[base]:
                raise _full(base, self.registry.limits[base])
            ref = AdapterRef(name, path, await self.registry.next_generation())
            error = await self.loaders[base](ref)
            if error is not None:
                raise APIError.from_info(error)
            outcome = await self.registry.register(
                AdapterEntry(ref, base, int(time.time())), body.load_inplace
            )
        if outcome == "exists":  # Another router replica registered it meanwhile.
            raise _already(name)
        if outcome == "full":
            raise _full(base, self.registry.limits[base])
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest, key_name: str | None) -> str:
        self.check_admin(key_name)
        name = body.lora_name
        if not name:
            raise _bad("'lora_name' needs to be provided to unload a LoRA adapter.")
        entry = await self.registry.lookup(name)
        if entry is not None and entry.base not in self.runtime_models:
            raise _bad(
                f"Runtime LoRA loading is off for `{entry.base}`, which serves '{name}': set "
                "lora.runtime_loading: true (or remove the adapter from the config)."
            )
        async with self._lock:
            found = entry is not None and await self.registry.unregister(name)
        if not found:
            raise APIError(
                f"The lora adapter '{name}' cannot be found.",
                status=404,
                param="lora_name",
                code="adapter_not_found",
            )
        return f"Success: LoRA adapter '{name}' removed successfully."


def _already(name: str) -> APIError:
    return _bad(
        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
        "in place, set 'load_inplace' to True."
    )


def _full(base: str, limit: int) -> APIError:
    return _bad(
        f"`{base}` already has {limit} adapters loaded at runtime "
        "(lora.max_runtime_adapters); unload one first."
    )


_admin: AdapterAdmin | None = None


def attach(admin: AdapterAdmin | None) -> None:
    """The router replica's verbs; None: no model of this app serves LoRA adapters."""
    global _admin
    _admin = admin


def _require() -> AdapterAdmin:
    if _admin is None:
        raise _bad(
            "This app serves no LoRA adapters: set lora.runtime_loading: true on a model.",
            param="lora_name",
        )
    return _admin


def _key_name(request: Request) -> str | None:
    return getattr(request.state, "api_key_name", None)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a LoRA adapter (vLLM's body: lora_name, lora_path, load_inplace)."""
    return PlainTextResponse(await _require().load(body, _key_name(request)))


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    """Unload a LoRA adapter: its name is a 404 from then on, on every router replica."""
    return PlainTextResponse(await _require().unload(body, _key_name(request)))
