"""The OpenAI protocol: request models (ours: vLLM extras, validation naming the `param`) and
response types (the openai SDK's own)."""

from __future__ import annotations

from serve_app.config.model import GenerationDefaults
from serve_app.openai.protocol.common import ErrorDetail, ErrorResponse, StreamOptions
from serve_app.openai.protocol.requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from serve_app.openai.protocol.responses import ChatCompletion, Completion, ModelList

__all__ = [
    "ChatCompletion",
    "ChatCompletionRequest",
    "ChatMessage",
    "Completion",
    "CompletionRequest",
    "ErrorDetail",
    "ErrorResponse",
    "GenerationDefaults",
    "ModelList",
    "StreamOptions",
]
