"""The application config (the ``args`` of a Serve config): the ground floor of serve_app.

It imports nothing of serve_app above it (no protocol, no HTTP, no engine), so every role can
import it, and it can be validated without Ray or vLLM.
"""

from __future__ import annotations

from serve_app.config.app import AppConfig, TracingConfig
from serve_app.config.autoscaling import EngineAutoscalingConfig
from serve_app.config.batch_api import BatchApiConfig
from serve_app.config.engine import EngineConfig
from serve_app.config.fair_share import FairShareConfig
from serve_app.config.model import GenerationDefaults, ModelConfig
from serve_app.config.replicas import PreprocessorConfig, ReplicaConfig
from serve_app.config.routing import RoutingConfig
from serve_app.config.security import KeyRateLimit, RequestLimits, SecurityConfig

__all__ = [
    "AppConfig",
    "BatchApiConfig",
    "EngineAutoscalingConfig",
    "EngineConfig",
    "FairShareConfig",
    "GenerationDefaults",
    "KeyRateLimit",
    "ModelConfig",
    "PreprocessorConfig",
    "ReplicaConfig",
    "RequestLimits",
    "RoutingConfig",
    "SecurityConfig",
    "TracingConfig",
]
