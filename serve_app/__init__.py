"""serve_app: an OpenAI-compatible LLM serving graph on Ray Serve + vLLM.

Public API: ``build_app`` (the Serve import path ``serve_app:build_app``) and the config types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serve_app.config import AppConfig, EngineConfig, ModelConfig, PreprocessorConfig, ReplicaConfig

if TYPE_CHECKING:
    from ray.serve import Application

__all__ = [
    "AppConfig",
    "EngineConfig",
    "ModelConfig",
    "PreprocessorConfig",
    "ReplicaConfig",
    "build_app",
]


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """Build the Router → Preprocessor → Engine application (imports Ray lazily)."""
    from serve_app.app import build_app as _build

    return _build(args)
