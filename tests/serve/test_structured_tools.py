"""Structured output, tool calling, prefix caching and /tokenize through the real graph."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.serve.conftest import MODEL

CONTRACT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "contract_type": {"type": "string", "enum": ["lease", "employment", "sale", "service"]},
        "parties": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "role": {
                        "type": "string",
                        "enum": ["buyer", "seller", "employer", "employee", "landlord", "tenant"],
                    },
                },
                "required": ["name", "role"],
                "additionalProperties": False,
            },
        },
        "amount": {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": 0},
                "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
            },
            "required": ["value", "currency"],
            "additionalProperties": False,
        },
        "auto_renew": {"type": "boolean"},
    },
    "required": ["title", "contract_type", "parties", "amount", "auto_renew"],
    "additionalProperties": False,
}

CONTRACTS = [
    f"{kind} agreement between {a} and {b} for {value} {cur}, signed in {city}."
    for kind, a, b, value, cur, city in [
        ("Lease", "Anna Schmidt", "Berlin Homes GmbH", 1200, "EUR", "Berlin"),
        ("Employment", "Acme Corp", "John Smith", 85000, "USD", "Boston"),
        ("Sale", "Maria Rossi", "Luca Bianchi", 15000, "EUR", "Rome"),
        ("Service", "CloudCo Ltd", "Shop4U", 300, "GBP", "London"),
        ("Lease", "Pierre Martin", "Paris Immo", 950, "EUR", "Paris"),
    ]
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_json_schema_outputs_parse_and_validate(client: OpenAI) -> None:
    """Every output the grammar finished is valid JSON for the schema; most finish in budget.

    A sampled output cut at ``max_tokens`` is unfinished JSON by design (OpenAI's own
    behaviour), so only finished ones (``finish_reason == "stop"``) are judged. How long a 135M
    model talks at T=0.7 is luck; that most outputs finish within 300 tokens is not.
    """

    def extract(i: int) -> tuple[str | None, str]:
        response = client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": "Extract the contract as JSON: " + CONTRACTS[i % len(CONTRACTS)],
                }
            ],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "contract", "schema": CONTRACT_SCHEMA, "strict": True},
            },
            max_tokens=300,
            temperature=0.7 if i >= len(CONTRACTS) else 0,
            seed=i,
        )
        choice = response.choices[0]
        return choice.finish_reason, choice.message.content or ""

    with ThreadPoolExecutor(max_workers=20) as pool:  # One engine batch, not 20 in a row.
        outputs = list(pool.map(extract, range(20)))
    assert {reason for reason, _ in outputs} <= {"stop", "length"}, outputs
    finished = [content for reason, content in outputs if reason == "stop"]
    print(f"\njson_schema: {len(finished)} of 20 outputs finished within 300 tokens")
    for content in finished:
        jsonschema.validate(json.loads(content), CONTRACT_SCHEMA)
    assert len(finished) >= 15, f"only {len(finished)} of 20 outputs finished: {outputs}"


def test_json_object_parses(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with keys name and age."}],
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_a_schema_holding_a_number_past_64_bits_is_served(client: OpenAI) -> None:
    # Annotations may hold any JSON number; msgpack (vLLM's hop to its engine core) holds
    # 64-bit ints only, which once made such a schema a 500.
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer", "examples": [2**80]}},
        "required": ["age"],
        "x-serial": 90990306043718518439936,
    }
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Give a JSON object with the key age."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        "max_tokens": 30,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**request).choices[0].message.content or ""
    chunks = client.chat.completions.create(**request, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    for text in (whole, streamed):
        assert text.lstrip().startswith("{"), text


def test_regex_and_choice_match_exactly(client: OpenAI) -> None:
    phone = (
        client.completions.create(
            model=MODEL,
            prompt="A phone number: ",
            max_tokens=20,
            temperature=0,
            extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(r"\d{3}-\d{4}", phone), phone
    for review in ["I love this product, it is great!", "Terrible, it broke after a day."]:
        label = (
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Sentiment of: {review}"}],
                max_tokens=5,
                temperature=0,
                extra_body={"guided_choice": ["positive", "negative", "neutral"]},
            )
            .choices[0]
            .message.content
        )
        assert label in ("positive", "negative", "neutral")


def test_forced_tool_call_round_trip(client: OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    # Feed the call and its result back: the model answers in text.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=30, temperature=0
    )
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


def test_required_tool_choice_and_streamed_tool_deltas(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome, in celsius?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    calls = response.choices[0].message.tool_calls or []
    # The grammar does not bound how many calls the model lists: the calls it completed within
    # max_tokens are reported, and a list cut short says "length".
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert response.choices[0].finish_reason == (
        "length" if response.usage and response.usage.completion_tokens == 80 else "tool_calls"
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER_TOOL],
        max_tokens=60,
        temperature=0,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    name, arguments, finish = "", "", None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            assert delta_call.index == 0
            name += delta_call.function.name or "" if delta_call.function else ""
            arguments += delta_call.function.arguments or "" if delta_call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]


def test_auto_tool_choice_is_well_formed(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Madrid?"}],
        tools=[WEATHER_TOOL],
        max_tokens=60,
        temperature=0,
    )
    choice = response.choices[0]
    if choice.message.tool_calls:  # The tiny model may or may not choose the tool itself.
        assert choice.finish_reason == "tool_calls"
        assert all(json.loads(c.function.arguments) is not None for c in choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_cached_tokens_reported_for_a_shared_prefix(client: OpenAI) -> None:
    system = "You are a contracts analyst. " + " ".join(
        f"Rule {i}: always cite clause {i} when relevant." for i in range(60)
    )
    usages = []
    for question in ["Summarize clause 3.", "Summarize clause 7."]:
        response = client.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
        assert response.usage is not None
        usages.append(response.usage)
    details = usages[1].prompt_tokens_details
    assert usages[1].prompt_tokens > 500
    assert details is not None and details.cached_tokens and details.cached_tokens >= 480


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_constraints_and_tools_are_400_with_param(
    base_url: str, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            **body,
        },
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_tokenize_and_detokenize_round_trip(base_url: str) -> None:
    text = "The capital of France is Paris."
    tokens = httpx.post(
        f"{base_url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 3
    assert tokens["max_model_len"] == 4096
    back = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}
    chat = httpx.post(
        f"{base_url}/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    ).json()
    completion = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"]
    bad = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": [10**8]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
