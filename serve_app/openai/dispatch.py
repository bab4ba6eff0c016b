"""Every name a client can put in `model`: the app's models and their LoRA adapters.

``ServedModels`` maps the request's `model` to the ``OpenAIServing`` that runs it: a model's
own, or its base model's bound to the adapter (same preprocessor and engine, the adapter named
on every engine request). Adapters come from an ``AdapterDirectory``: the config's plus those
loaded at runtime, shared by every router replica (``graph/adapter_registry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve_app.errors import model_not_found
from serve_app.hops import AdapterRef
from serve_app.openai.protocol.responses import Model, ModelList
from serve_app.openai.serving import OpenAIServing

# Names an unknown-model error lists at most (the rest are counted).
LISTED_NAMES = 20


@dataclass(frozen=True)
class AdapterEntry:
    """A LoRA adapter clients can name: on which model, loaded from where."""

    ref: AdapterRef
    base: str  # The served name of the model it runs on.
    created: int = 0

    @property
    def name(self) -> str:
        return self.ref.name


class AdapterDirectory(Protocol):
    async def lookup(self, name: str) -> AdapterEntry | None:
        """The adapter called ``name`` now, or None."""
        ...

    async def entries(self) -> list[AdapterEntry]:
        """Every adapter now, by name."""
        ...


class NoAdapters:
    """The directory of an app without LoRA."""

    async def lookup(self, name: str) -> AdapterEntry | None:
        return None

    async def entries(self) -> list[AdapterEntry]:
        return []


class ServedModels:
    """Dispatch on `model`; the first model's serving resolves through it, so every caller
    holding that serving (the routes, the Batch API) reaches every model and adapter."""

    def __init__(
        self, servings: list[OpenAIServing], adapters: AdapterDirectory | None = None
    ) -> None:
        self.servings = {serving.model_name: serving for serving in servings}
        self.primary = servings[0]
        self.adapters = adapters or NoAdapters()
        if len(servings) > 1 or adapters is not None:
            for serving in servings:
                serving.resolver = self.resolve

    async def resolve(self, model: str) -> OpenAIServing:
        serving = self.servings.get(model)
        if serving is not None:
            return serving
        entry = await self.adapters.lookup(model)
        if entry is not None and entry.base in self.servings:
            return self.servings[entry.base].with_adapter(entry.ref)
        names = [*self.servings, *(e.name for e in await self.adapters.entries())]
        listed = names[:LISTED_NAMES]
        if len(names) > LISTED_NAMES:
            listed.append(f"and {len(names) - LISTED_NAMES} more (GET /v1/models)")
        raise model_not_found(model, listed)

    async def model_list(self, max_model_lens: dict[str, int | None]) -> ModelList:
        """GET /v1/models: every model, then every adapter with its `parent` (vLLM's shape:
        root is the checkpoint or adapter source, max_model_len the context window)."""
        cards = [
            Model(
                id=name,
                object="model",
                created=serving.created,
                owned_by="serve_app",
                root=serving.config.model.name,
                max_model_len=max_model_lens.get(name),
            )
            for name, serving in self.servings.items()
        ]
        for entry in await self.adapters.entries():
            base = self.servings.get(entry.base)
            if base is None:
                continue
            cards.append(
                Model(
                    id=entry.name,
                    object="model",
                    created=entry.created or base.created,
                    owned_by="serve_app",
                    root=entry.ref.source,
                    parent=entry.base,
                    max_model_len=max_model_lens.get(entry.base),
                )
            )
        return ModelList(object="list", data=cards)
