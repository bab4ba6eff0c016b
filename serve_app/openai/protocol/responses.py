"""OpenAI response bodies: the ``openai`` SDK's own types, so the wire format cannot drift.

Full responses are built as SDK objects (``ChatCompletion``, ``Completion``, ``Model``). Stream
chunks are built as the plain dicts ``ChatCompletionChunk`` / ``Completion`` describe, because
one is encoded per engine step of every stream and pydantic construction would cost more than
the rest of the hop; ``tests/serve/test_wire_format.py`` validates every chunk the app sends
against the SDK types in strict mode.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs as ChatLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs as CompletionLogprobs
from openai.types.completion_usage import PromptTokensDetails
from pydantic import BaseModel

__all__ = [
    "ChatChoice",
    "ChatCompletion",
    "ChatCompletionMessage",
    "ChatCompletionTokenLogprob",
    "ChatLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionUsage",
    "Function",
    "Model",
    "ModelList",
    "PromptTokensDetails",
    "ToolCall",
    "TopLogprob",
    "chat_chunk",
    "completion_chunk",
    "dump",
]

ToolCall = ChatCompletionMessageFunctionToolCall


class ModelList(BaseModel):
    """GET /v1/models: the SDK pages over ``Model`` objects; this is the page."""

    object: Literal["list"] = "list"
    data: list[Model]


def dump(response: BaseModel) -> dict[str, Any]:
    """The JSON body of an SDK object: exactly the fields we set (SDK types default every
    optional field to None; OpenAI omits most of them)."""
    return response.model_dump(mode="json", exclude_unset=True)


def chat_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: CompletionUsage | None = None,
) -> str:
    """One ``chat.completion.chunk`` as JSON; ``choices`` hold index, delta, logprobs and
    finish_reason."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = dump(usage)
    return json.dumps(chunk, separators=(",", ":"))


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: CompletionUsage | None = None,
) -> str:
    """One streamed ``text_completion`` as JSON (OpenAI streams the response type itself)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = dump(usage)
    return json.dumps(chunk, separators=(",", ":"))
