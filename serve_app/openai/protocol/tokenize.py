"""vLLM-compatible /tokenize and /detokenize bodies."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from serve_app.openai.protocol.common import OpenAIModel
from serve_app.openai.protocol.requests import ChatMessage
from serve_app.openai.protocol.structured import ToolDef

TokenId = Annotated[int, Field(ge=0)]


class TokenizeRequest(OpenAIModel):
    """Either ``prompt`` (completions style) or ``messages`` (rendered with the chat template)."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as the chat template sees them (validated like a chat request's)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []] or None


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
