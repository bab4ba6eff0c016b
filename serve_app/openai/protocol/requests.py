"""OpenAI request bodies for /v1/chat/completions and /v1/completions (fields in doc order)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal, cast

from pydantic import Field, model_validator

from serve_app.errors import APIError
from serve_app.hops import SamplingSpec
from serve_app.openai.protocol.common import GenerationDefaults, OpenAIModel, SamplingFields
from serve_app.openai.protocol.structured import StructuredFields, ToolChoice, ToolDef, tool_spec


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates concatenate content: an assistant turn holding only tool calls gets "".
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    # Chat templates render arguments with `tojson`: give them the object, not a JSON string.
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


class ChatCompletionRequest(SamplingFields, StructuredFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    model: str
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(
        None, ge=1, description="Deprecated alias of max_completion_tokens."
    )
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras for the chat template. Only the server's allow-list of keys is accepted
    # (security.allowed_chat_template_kwargs); the template itself is the operator's.
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(
        None, description="Refused: set model.chat_template on the server instead."
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt set to false")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools to choose from")
        if self.chat_template is not None:
            # vLLM too refuses request templates (unless --trust-request-chat-template): Jinja
            # from a client runs in the preprocessor, next to every other tenant's requests.
            raise ValueError(
                "chat_template: templates from requests are not accepted; the server's operator "
                "can set model.chat_template"
            )
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as the chat template sees them; hidden when tool_choice is none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice is not None and self.tool_choice not in ("none", "auto")

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_spec(self, defaults: GenerationDefaults) -> SamplingSpec:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        spec = self._sampling_spec(defaults, max_tokens=max_tokens, logprobs=logprobs)
        structured = self.structured_spec()
        forced = tool_spec(self.tools or [], self.tool_choice)
        if forced is not None and structured is not None:
            raise APIError(
                "A forced tool_choice already constrains the output; drop "
                f"{structured.param} or set tool_choice to auto",
                param=structured.param,
            )
        return replace(spec, structured=forced or structured)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# The protocol's outer bound; security.limits.max_prompts (1,024 by default) is the usual one.
MAX_PROMPTS = 100_000
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class CompletionRequest(SamplingFields, StructuredFields):
    model: str
    prompt: Prompt
    best_of: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: values other than n are not supported; use n")
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """Normalize the four OpenAI prompt shapes to a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [cast(list[int], prompt)]
        return cast(list[str | list[int]], list(prompt))

    def to_sampling_spec(self, defaults: GenerationDefaults) -> SamplingSpec:
        spec = self._sampling_spec(defaults, max_tokens=self.max_tokens, logprobs=self.logprobs)
        return replace(spec, structured=self.structured_spec())
