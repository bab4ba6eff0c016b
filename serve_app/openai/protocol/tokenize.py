"""vLLM-compatible /tokenize and /detokenize bodies."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from serve_app.openai.protocol.common import OpenAIModel
from serve_app.openai.protocol.requests import ChatMessage

TokenId = Annotated[int, Field(ge=0)]


class TokenizeRequest(OpenAIModel):
    """Either ``prompt`` (completions style) or ``messages`` (rendered with the chat template)."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


class DetokenizeResponse(BaseModel):
    prompt: str
