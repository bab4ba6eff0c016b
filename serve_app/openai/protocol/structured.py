"""Structured output and tool definitions: OpenAI's ``response_format``/``tools``/``tool_choice``
plus vLLM's ``structured_outputs`` and legacy ``guided_*`` extras, turned into one constraint."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from serve_app.errors import APIError
from serve_app.hops import StructuredSpec
from serve_app.openai.protocol.common import OpenAIModel


class JsonSchemaFormat(OpenAIModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIModel):
    """vLLM's ``structured_outputs`` request field: exactly one of these constraints."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(OpenAIModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenAIModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredFields(OpenAIModel):
    """Fields shared by chat and completions that constrain the output's shape."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredSpec | None:
        """The single constraint requested, or None; two at once is a 400."""
        found: list[StructuredSpec] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(StructuredSpec("json_object", True, "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(
                    "response_format.json_schema.schema is required for type json_schema",
                    param="response_format.json_schema",
                )
            found.append(
                StructuredSpec(
                    "json", fmt.json_schema.json_schema, "response_format.json_schema.schema"
                )
            )
        so = self.structured_outputs
        if so is not None:
            for kind, value in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object),
            ):
                if value is not None:
                    param = f"structured_outputs.{kind}"
                    found.append(StructuredSpec(kind, value, param))  # type: ignore[arg-type]
        for kind, value in (
            ("json", self.guided_json),
            ("regex", self.guided_regex),
            ("choice", self.guided_choice),
            ("grammar", self.guided_grammar),
        ):
            if value is not None:
                found.append(StructuredSpec(kind, value, f"guided_{kind}"))  # type: ignore[arg-type]
        if len(found) > 1:
            raise APIError(
                "Only one output constraint is allowed per request; got "
                + ", ".join(spec.param for spec in found),
                param=found[1].param,
            )
        return found[0] if found else None


def tool_spec(tools: list[ToolDef], choice: ToolChoice | None) -> StructuredSpec | None:
    """The constraint that forces a tool call: a named function or ``required``."""
    if isinstance(choice, NamedToolChoice):
        by_name = {tool.function.name: tool for tool in tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise APIError(
                f"tool_choice names `{choice.function.name}`, which is not in tools "
                f"({', '.join(by_name) or 'none given'})",
                param="tool_choice",
            )
        return StructuredSpec("json", _parameters(tool), "tool_choice")
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "arguments": _parameters(tool),
                },
                "required": ["name", "arguments"],
            }
            for tool in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredSpec("json", schema, "tool_choice")
    return None


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}
