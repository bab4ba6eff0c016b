"""The OpenAI protocol: request and response models, fields in the order of the OpenAI docs."""

from __future__ import annotations

from serve_app.openai.protocol.common import (
    ErrorDetail,
    ErrorResponse,
    GenerationDefaults,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    StreamOptions,
    UsageInfo,
)
from serve_app.openai.protocol.requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from serve_app.openai.protocol.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCallOut,
    ToolCallOut,
    TopLogprobOut,
)

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "ErrorDetail",
    "ErrorResponse",
    "FunctionCallOut",
    "GenerationDefaults",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "StreamOptions",
    "ToolCallOut",
    "TopLogprobOut",
    "UsageInfo",
]
