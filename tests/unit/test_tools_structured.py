"""Tool-call parsing (hermes format), streaming deltas, and the pre-engine constraint checks."""

from __future__ import annotations

import json

import pytest

from serve_app.errors import APIError
from serve_app.hops import StructuredSpec
from serve_app.openai.protocol import ChatCompletionRequest, GenerationDefaults
from serve_app.openai.protocol.structured import NamedToolChoice
from serve_app.openai.tools import ToolStream, parse_auto, parse_forced
from serve_app.preprocess.constraints import check_structured, check_tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_parse_auto_splits_content_and_calls() -> None:
    content, calls = parse_auto("Let me check. " + CALL)
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")


def test_parse_auto_leaves_malformed_calls_as_text() -> None:
    text = "<tool_call>{not json}</tool_call>"
    assert parse_auto(text) == (text, [])
    assert parse_auto("no tools here") == ("no tools here", [])


def test_parse_forced_named_and_required() -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    [call] = parse_forced('{"x": 1}', named)
    assert call.function.name == "f" and call.function.arguments == '{"x": 1}'
    calls = parse_forced(
        '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": 2}}]', "required"
    )
    assert [c.function.name for c in calls] == ["a", "b"]
    assert parse_forced('[{"name": "a", "argu', "required") == []
    # Cut off by max_tokens after a complete call: the complete calls are still reported.
    cut = parse_forced('[{"name": "a", "arguments": {"x": 1}},\n {"name": "a", "argu', "required")
    assert [(c.function.name, c.function.arguments) for c in cut] == [("a", '{"x": 1}')]


@pytest.mark.parametrize("pieces", [[CALL], list(CALL), ["Sure. <tool", "_call>", CALL[11:]]])
def test_tool_stream_auto_reassembles_calls_from_any_split(pieces: list[str]) -> None:
    stream = ToolStream("auto")
    content, calls = "", []
    for piece in pieces:
        text, deltas = stream.feed(piece)
        content += text or ""
        calls += deltas
    text, deltas = stream.finish()
    content += text or ""
    calls += deltas
    assert "<tool" not in content
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["index"] == 0


def test_tool_stream_named_streams_arguments() -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    stream = ToolStream(named)
    _, first = stream.feed('{"a"')
    _, second = stream.feed(": 1}")
    assert first[0]["function"] == {"name": "f", "arguments": '{"a"'} and "id" in first[0]
    assert second == [{"index": 0, "function": {"arguments": ": 1}"}}]


def chat(**extra: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    )


def test_named_tool_choice_becomes_a_json_constraint() -> None:
    request = chat(
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    spec = request.to_sampling_spec(GenerationDefaults()).structured
    assert spec is not None and spec.kind == "json" and spec.value["required"] == ["city"]


def test_unknown_named_tool_and_double_constraints_are_rejected() -> None:
    with pytest.raises(APIError) as info:
        chat(
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        ).to_sampling_spec(GenerationDefaults())
    assert info.value.info.param == "tool_choice"
    with pytest.raises(APIError) as info:
        chat(response_format={"type": "json_object"}, guided_regex="a+").to_sampling_spec(
            GenerationDefaults()
        )
    assert info.value.info.param == "guided_regex"


def test_response_format_json_schema_and_vllm_extras() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = (
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
        .to_sampling_spec(GenerationDefaults())
        .structured
    )
    assert spec is not None and spec.value == schema
    assert spec.param == "response_format.json_schema.schema"
    extra = (
        chat(structured_outputs={"choice": ["yes", "no"]})
        .to_sampling_spec(GenerationDefaults())
        .structured
    )
    assert extra is not None and (extra.kind, extra.value) == ("choice", ["yes", "no"])


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (
            StructuredSpec("json", {"type": "strin"}, "response_format.json_schema.schema"),
            "response_format.json_schema.schema",
        ),
        (
            StructuredSpec("json", {"type": "object", "minProperties": -1}, "guided_json"),
            "guided_json",
        ),
        (StructuredSpec("regex", "([a-z", "structured_outputs.regex"), "structured_outputs.regex"),
        (StructuredSpec("grammar", "root ::= (", "guided_grammar"), "guided_grammar"),
    ],
)
def test_bad_constraints_fail_with_param(spec: StructuredSpec, param: str) -> None:
    with pytest.raises(APIError) as info:
        check_structured(spec)
    assert info.value.info.param == param and info.value.info.status == 400


def test_good_constraints_pass_and_bad_tool_schema_fails() -> None:
    check_structured(StructuredSpec("json", {"type": "object"}, "p"))
    check_structured(StructuredSpec("regex", r"\d{3}-[A-Z]+", "p"))
    check_structured(StructuredSpec("grammar", 'root ::= "yes" | "no"', "p"))
    with pytest.raises(APIError) as info:
        check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}])
    assert info.value.info.param == "tools[0].function.parameters"
