"""The application config (the ``args`` of a Serve config): the ground floor of serve_app."""

from __future__ import annotations

from serve_app.config.app import AppConfig, TracingConfig
from serve_app.config.autoscaling import EngineAutoscalingConfig
from serve_app.config.batch import BatchApiConfig
from serve_app.config.engine import EngineConfig
from serve_app.config.lora import LoraConfig
from serve_app.config.model import GenerationDefaults, ModelConfig
from serve_app.config.models import ModelBlock
from serve_app.config.replicas import PreprocessorConfig, ReplicaConfig
from serve_app.config.routing import RoutingConfig
from serve_app.config.security import KeyRateLimit, RequestLimits, SecurityConfig

__all__ = [
    "AppConfig",
    "BatchApiConfig",
    "EngineAutoscalingConfig",
    "EngineConfig",
    "GenerationDefaults",
    "KeyRateLimit",
    "LoraConfig",
    "ModelBlock",
    "ModelConfig",
    "PreprocessorConfig",
    "ReplicaConfig",
    "RequestLimits",
    "RoutingConfig",
    "SecurityConfig",
    "TracingConfig",
]
