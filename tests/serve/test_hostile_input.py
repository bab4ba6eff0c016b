"""Hostile input over real HTTP (the shared app, no keys): exact status, type, param and code.

Every case must get an OpenAI-shaped error, never a 5xx, a hang or a FastAPI ``{"detail"}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
COMP: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
LONG = "word " * 5000  # Beyond the 4096-token window, within the body limit.
DEEP = "[" * 100_000 + "]" * 100_000  # Nesting deeper than any recursive parser allows.
BIG = 3 * 1024 * 1024  # Beyond the default 2 MiB body limit.
IRE = "invalid_request_error"
# A template that would loop ~10^10 times, each allocating a GB: never run, refused unread.
BOMB = "{% for i in range(99999) %}{% for j in range(99999) %}{{ 'x' * 10**9 }}{% endfor %}" + (
    "{% endfor %}"
)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _chunks() -> Iterator[bytes]:
    for _ in range(BIG // 65536):
        yield b" " * 65536


def _c(
    id_: str,
    request: tuple[str, Any],
    status: int,
    param: str | None,
    code: str | None,
    *marks: Any,
) -> Any:
    route, content = request
    return pytest.param(route, content, status, param, code, id=id_, marks=marks)


def ch(**fields: Any) -> tuple[str, bytes]:
    """A chat request: CHAT with `fields` changed (None removes a field)."""
    return "chat", _json({k: v for k, v in {**CHAT, **fields}.items() if v is not None})


def co(**fields: Any) -> tuple[str, bytes]:
    return "completions", _json({k: v for k, v in {**COMP, **fields}.items() if v is not None})


def raw(route: str, text: str | bytes) -> tuple[str, bytes]:
    return route, text.encode() if isinstance(text, str) else text


def chat_with(extra: str) -> tuple[str, bytes]:
    """CHAT plus literal JSON text (NaN, Infinity, ... that json.dumps will not write)."""
    return raw("chat", _json(CHAT).decode()[:-1] + ", " + extra + "}")


def msg(**fields: Any) -> tuple[str, bytes]:
    return ch(messages=[fields])


IV, CL, NF = "invalid_value", "context_length_exceeded", "model_not_found"
SURR = '"\\ud800"'  # A lone surrogate, escaped as JSON allows.
# Every error is type invalid_request_error: (id, request, status, param, code, *marks).
CASES: list[Any] = [
    # Malformed JSON and wrong top-level shapes.
    _c("json-garbage", raw("chat", "{not json"), 400, None, "invalid_json"),
    _c("json-truncated", raw("chat", '{"model": "x", "messages": ['), 400, None, "invalid_json"),
    _c("json-trailing", raw("chat", _json(CHAT) + b"}"), 400, None, "invalid_json"),
    _c("json-not-utf8", raw("chat", b'{"model": "\xff\xfe"}'), 400, None, "invalid_json"),
    _c("deep-nesting", chat_with(f'"x": {DEEP}'), 400, None, "invalid_json"),
    _c("json-empty-body", raw("chat", b""), 400, None, IV),
    _c("json-array", raw("chat", _json([CHAT])), 400, None, IV),
    _c("json-string", raw("completions", _json("hello")), 400, None, IV),
    _c("json-null", raw("chat", "null"), 400, None, IV),
    # Numbers: NaN, Infinity, negatives, huge, wrong types.
    _c("nan-temperature", chat_with('"temperature": NaN'), 400, "temperature", IV),
    _c("inf-top-p", chat_with('"top_p": -Infinity'), 400, "top_p", IV),
    _c("overflow-float", chat_with('"temperature": 1e400'), 400, "temperature", IV),
    _c("inf-max-tokens", chat_with('"max_tokens": Infinity'), 400, "max_tokens", IV),  # Last wins.
    _c("negative-max-tokens", ch(max_tokens=-5), 400, "max_tokens", IV),
    _c("fractional-max-tokens", co(max_tokens=1.5), 400, "max_tokens", IV),
    _c("huge-max-tokens", ch(max_tokens=10**30), 400, "max_tokens", CL),
    _c("huge-n", ch(n=10**20), 400, "n", IV),
    _c("zero-n", co(n=0), 400, "n", IV),
    _c("greedy-n", co(n=2, temperature=0, prompt=["a", "b"]), 400, "n", None),
    _c("huge-seed", ch(seed=2**64), 400, "seed", IV),
    _c("negative-temperature", ch(temperature=-0.1), 400, "temperature", IV),
    _c("top-p-above-1", co(top_p=1.5), 400, "top_p", IV),
    _c("penalty-range", ch(presence_penalty=3), 400, "presence_penalty", IV),
    _c("penalty-type", ch(frequency_penalty="x"), 400, "frequency_penalty", IV),
    _c("logit-bias-value", ch(logit_bias={"1": 200}), 400, "logit_bias", IV),
    _c("logit-bias-key", co(logit_bias={"abc": 1}), 400, "logit_bias", IV),
    _c("top-k-below-minus-1", ch(top_k=-5), 400, "top_k", IV),
    _c("repetition-penalty-zero", ch(repetition_penalty=0), 400, "repetition_penalty", IV),
    _c("top-logprobs-21", ch(logprobs=True, top_logprobs=21), 400, "top_logprobs", IV),
    _c("completion-logprobs-50", co(logprobs=50), 400, "logprobs", IV),
    _c("stop-too-many", ch(stop=["x"] * 17), 400, "stop", IV),
    _c("stop-type", co(stop=5), 400, "stop", IV),
    _c("stream-type", ch(stream=[1]), 400, "stream", IV),
    _c("stream-options-no-stream", ch(stream_options={"include_usage": True}), 400,
       "stream_options", IV),
    _c("best-of-not-n", co(best_of=3), 400, "best_of", IV),
    _c("suffix", co(suffix="x"), 400, "suffix", IV),
    # Model.
    _c("unknown-model", ch(model="gpt-nope"), 404, "model", NF),
    _c("unknown-model-path", co(model="../../etc/passwd"), 404, "model", NF),
    _c("model-type", ch(model=7), 400, "model", IV),
    _c("model-missing", raw("completions", _json({"prompt": "hi"})), 400, "model", IV),
    # Messages.
    _c("unknown-role", msg(role="wizard", content="x"), 400, "messages[0].role", IV),
    _c("missing-role", msg(content="x"), 400, "messages[0].role", IV),
    _c("content-type", msg(role="user", content=5), 400, "messages[0].content", IV),
    _c("bad-content-part", msg(role="user", content=[{"type": "video", "url": "x"}]), 400,
       "messages[0].content", IV),
    _c("tool-message-no-id", msg(role="tool", content="x"), 400, "messages[0]", IV),
    _c("user-message-no-content", msg(role="user"), 400, "messages[0]", IV),
    _c("empty-messages", ch(messages=[]), 400, "messages", IV),
    _c("messages-string", ch(messages="hello"), 400, "messages", IV),
    _c("null-messages", raw("chat", _json({**CHAT, "messages": None})), 400, "messages", IV),
    _c("too-many-messages", ch(messages=USER * 4097), 400, "messages", IV),
    # Templates are the operator's: only allow-listed flags (enable_thinking by default).
    _c("template-kwargs-tokenize", ch(chat_template_kwargs={"tokenize": True}), 400,
       "chat_template_kwargs.tokenize", IV),
    _c("template-kwargs-template", ch(chat_template_kwargs={"chat_template": BOMB}), 400,
       "chat_template_kwargs.chat_template", IV),
    _c("template-kwargs-tools", ch(chat_template_kwargs={"tools": [TOOL]}), 400,
       "chat_template_kwargs.tools", IV),
    _c("template-kwargs-documents", ch(chat_template_kwargs={"documents": [{"text": "x"}]}),
       400, "chat_template_kwargs.documents", IV),
    _c("template-kwargs-unknown", ch(chat_template_kwargs={"bos_token": "{{ 7 * 7 }}"}), 400,
       "chat_template_kwargs.bos_token", IV),
    _c("template-kwargs-list", ch(chat_template_kwargs=["enable_thinking"]), 400,
       "chat_template_kwargs", IV),
    _c("request-chat-template", ch(chat_template=BOMB), 400, "chat_template", IV),
    # Strict JSON types: no string (or number) to bool, no string to number, as OpenAI.
    _c("string-bool-stream", ch(stream="yes"), 400, "stream", IV),
    _c("string-bool-echo", co(echo="true"), 400, "echo", IV),
    _c("int-bool-logprobs", ch(logprobs=1), 400, "logprobs", IV),
    _c("string-bool-ignore-eos", co(ignore_eos="false"), 400, "ignore_eos", IV),
    _c("string-bool-add-generation-prompt", ch(add_generation_prompt="no"), 400,
       "add_generation_prompt", IV),
    _c("string-bool-nested", ch(stream=True, stream_options={"include_usage": "yes"}), 400,
       "stream_options.include_usage", IV),
    _c("string-bool-tool-strict",
       ch(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]), 400,
       "tools[0].function.strict", IV),
    _c("string-number-n", co(n="2"), 400, "n", IV),
    _c("float-number-n", ch(n=2.0), 400, "n", IV),
    _c("string-number-temperature", ch(temperature="0.5"), 400, "temperature", IV),
    _c("bool-number-top-p", ch(top_p=True), 400, "top_p", IV),
    _c("string-number-max-tokens", co(max_tokens="5"), 400, "max_tokens", IV),
    _c("string-number-seed", co(seed="1"), 400, "seed", IV),
    _c("string-number-priority", ch(priority="-100"), 400, "priority", IV),
    _c("string-number-logit-bias", co(logit_bias={"1": "5"}), 400, "logit_bias", IV),
    # Prompts.
    _c("long-chat-prompt", msg(role="user", content=LONG), 400, "messages", CL),
    _c("long-completion-prompt", co(prompt=LONG), 400, "prompt", CL),
    _c("empty-prompt", co(prompt=""), 400, "prompt", None),
    _c("empty-prompt-list", co(prompt=[]), 400, "prompt", IV),
    _c("too-many-prompts", co(prompt=["a"] * 1025), 400, "prompt", "array_above_max_length"),
    _c("nested-empty-prompt", co(prompt=[[]]), 400, "prompt", IV),
    _c("negative-token-id", co(prompt=[-1]), 400, "prompt", IV),
    _c("token-id-beyond-vocab", co(prompt=[1, 10**9]), 400, "prompt", None),
    _c("prompt-object", co(prompt={"text": "hi"}), 400, "prompt", IV),
    _c("lone-surrogate", raw("chat", _json(CHAT).decode().replace('"hi"', SURR)), 400,
       "messages", None),
    _c("lone-surrogate-prompt", raw("completions", _json(COMP).decode().replace('"hi"', SURR)),
       400, "prompt", None),
    # Accepted by validation, then rejected by vLLM: must be a 400, not a 5xx.
    _c("empty-prompt-in-list", co(prompt=["hi", ""]), 400, "prompt", None),
    _c("stop-token-id-beyond-vocab", ch(stop_token_ids=[10**6]), 400, "stop_token_ids", None),
    _c("logit-bias-beyond-vocab", co(logit_bias={"99999999": 1}), 400, "logit_bias", None),
    _c("min-tokens-above-max-tokens", ch(min_tokens=10), 400, "min_tokens", None),
    _c("priority-below-int64", co(priority=-(2**63) - 1), 400, "priority", IV),
    _c("priority-above-int32", co(priority=2**31), 400, "priority", IV),
    _c("priority-string", ch(priority="high"), 400, "priority", IV),
    _c("priority-fractional", co(priority=0.5), 400, "priority", IV),
    # Size limits (the security middleware).
    _c("oversized-body", raw("chat", b"x" * BIG), 413, None, "request_too_large"),
    _c("oversized-chunked-body", ("completions", "chunked"), 413, None, "request_too_large"),
    # Tools.
    _c("tools-not-list", ch(tools="get_weather"), 400, "tools", IV),
    _c("tool-bad-type", ch(tools=[{**TOOL, "type": "retrieval"}]), 400, "tools[0].type", IV),
    _c("tool-no-function", ch(tools=[{"type": "function"}]), 400, "tools[0].function", IV),
    _c("tool-bad-name", ch(tools=[{"type": "function", "function": {"name": "get weather!"}}]),
       400, "tools[0].function.name", IV),
    _c("tool-choice-without-tools", ch(tool_choice="required"), 400, "tool_choice", IV),
    _c("tool-choice-unknown-function",
       ch(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}}), 400,
       "tool_choice", None),
    _c("tool-choice-bad-string", ch(tools=[TOOL], tool_choice="always"), 400, "tool_choice", IV),
    _c("too-many-tools", ch(tools=[TOOL] * 129), 400, "tools", IV),
    # response_format.
    _c("response-format-unknown", ch(response_format={"type": "xml"}), 400,
       "response_format.type", IV),
    _c("response-format-string", ch(response_format="json"), 400, "response_format", IV),
    _c("response-format-no-schema", ch(response_format={"type": "json_schema"}), 400,
       "response_format.json_schema", None),
    _c("response-format-bad-name",
       co(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
       400, "response_format.json_schema.name", IV),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "status", "param", "code"), CASES)
def test_hostile_request_gets_exact_openai_error(
    base_url: str, route: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    content = _chunks() if body == "chunked" else body
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{base_url}{path}", content=content, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["type"], error["param"], error["code"]) == (IRE, param, code), error
    assert error["message"]


def test_case_count() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        pytest.param("GET", "/health", {"x-junk": "j" * 10_000}, 431,
                     "request_header_fields_too_large", id="big-header-431"),
        pytest.param("GET", "/v1/models", {"x-a": "a" * 4000, "x-b": "b" * 4500}, 431,
                     "request_header_fields_too_large", id="many-headers-431"),
        pytest.param("POST", "/v1/chat/completions", {"content-type": "text/plain"}, 400,
                     "invalid_value", id="text-plain-body"),
    ],
)  # fmt: skip
def test_hostile_headers(
    base_url: str, method: str, path: str, headers: dict[str, str], status: int, code: str
) -> None:
    response = httpx.request(
        method, f"{base_url}{path}", headers=headers, content=_json(CHAT), timeout=60
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405), ("GET", "/v1/nope", 404)],
)
def test_wrong_method_or_route_is_openai_shaped(
    base_url: str, method: str, path: str, status: int
) -> None:
    response = httpx.request(method, f"{base_url}{path}", timeout=30)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_server_survives_and_still_answers(base_url: str) -> None:
    """After all of the above, a normal request still works."""
    response = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=120)
    assert response.status_code == 200, response.text


def test_bad_neighbour_does_not_fail_a_good_request(base_url: str) -> None:
    """A hostile request must not take down the others preprocessed in the same batch."""
    from concurrent.futures import ThreadPoolExecutor

    bad = _json(CHAT).decode().replace('"hi"', SURR).encode()
    url = f"{base_url}/v1/chat/completions"
    headers = {"content-type": "application/json"}

    def post(content: bytes) -> int:
        return httpx.post(url, content=content, headers=headers, timeout=120).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        good = list(pool.map(post, [_json(CHAT), bad] * 4))[::2]
    assert good == [200] * 4, good


def test_a_negative_priority_is_served_at_the_keys_floor(base_url: str) -> None:
    """No key here may go below 0: a client asking for -1 or -2**31 is served, not refused, at
    priority 0 (the router raises it; tests/unit/test_tenancy.py checks the value)."""
    for priority in (-1, -(2**31)):
        for route, body in (("chat/completions", CHAT), ("completions", COMPLETION)):
            response = httpx.post(
                f"{base_url}/v1/{route}", json={**body, "priority": priority}, timeout=120
            )
            assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("chat", {**CHAT, "temperature": 0, "top_p": 1, "presence_penalty": 0}),
        ("completions", {**COMP, "logit_bias": {"100": 1}, "temperature": 1}),
    ],
    ids=["ints-as-floats-chat", "ints-as-floats-completion"],
)
def test_strict_types_still_take_an_int_where_a_number_belongs(
    base_url: str, route: str, body: dict[str, Any]
) -> None:
    """JSON has one number type: `"temperature": 0` is a float to OpenAI, and to us."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    response = httpx.post(f"{base_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"model": MODEL, "messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
    ],
    ids=["tokenize-string-bool", "tokenize-int-bool"],
)
def test_tokenize_types_are_strict_too(base_url: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{base_url}/tokenize", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_allowed_template_kwarg_is_served(base_url: str) -> None:
    """The allow-list's default flag (enable_thinking) still reaches the template."""
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {**COMP, "guided_choice": ["yes", "no"], "logprobs": 5}),
        ("chat", {**CHAT, "response_format": {"type": "json_object"}, "logprobs": True,
                  "top_logprobs": 5}),
    ],
)  # fmt: skip
def test_logprobs_with_constrained_output_are_valid_json(
    base_url: str, route: str, body: dict[str, Any]
) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    response = httpx.post(f"{base_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text


MiB = 1024 * 1024


def router_rss() -> int:
    """Resident memory of the shared app's Router replica (its pid from Ray's state API)."""
    import psutil
    import ray
    from ray.util.state import list_actors

    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,  # This session's cluster, not another.
        filters=[("class_name", "=", "ServeReplica:llm:Router"), ("state", "=", "ALIVE")],
    )
    assert len(actors) == 1, actors
    return int(psutil.Process(actors[0].pid).memory_info().rss)


@pytest.fixture(scope="module", autouse=True)
def rss_at_start(base_url: str) -> int:
    return router_rss()


def _unknown_fields(round_: int, count: int) -> dict[str, int]:
    return {f"x{round_}_{i}": i for i in range(count)}


def test_100k_unknown_fields_are_served_and_memory_stays_flat(base_url: str) -> None:
    """Each body names 100k new fields (~1.6 MiB): all ignored, none kept. Before, every
    distinct name was remembered (and logged) for good."""
    url = f"{base_url}/v1/chat/completions"
    for warm in range(2):  # Allocator and code paths warm up.
        body = {**CHAT, **_unknown_fields(warm, 100_000)}
        assert httpx.post(url, json=body, timeout=300).status_code == 200
    before = router_rss()
    for round_ in range(2, 14):
        body = {**CHAT, **_unknown_fields(round_, 100_000)}
        response = httpx.post(url, json=body, timeout=300)
        assert response.status_code == 200, response.text[:300]
    nested = {**CHAT, "messages": [{**USER[0], **_unknown_fields(99, 20_000)}]}
    assert httpx.post(url, json=nested, timeout=300).status_code == 200
    # 1.2M distinct names went through; kept, they would be well over 100 MiB.
    assert router_rss() - before < 40 * MiB


def test_health_flood_is_rate_limited_and_probes_recover(base_url: str) -> None:
    """/health needs no key, so a flood of it gets the open paths' budget per router replica
    (conftest: 5 per second): 429s with Retry-After, no 5xx, and a probe a moment later is 200."""
    import asyncio
    import time

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            return list(await asyncio.gather(*(http.get(f"{base_url}/health") for _ in range(200))))

    responses = asyncio.run(flood())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, sorted(set(statuses))
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    time.sleep(1.5)  # A second's worth of budget is back on every router replica.
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def test_giant_multi_prompt_request_is_served_in_full(base_url: str) -> None:
    """512 prompts in one request (the limit is 1,024): 512 engine requests, every one answered.
    Meanwhile the engine holds its most ongoing requests (512), and readiness stays 200: it is
    cached controller state, not a call queued behind them."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Item {i}:" for i in range(512)]
    body = {**COMP, "prompt": prompts, "max_tokens": 8, "ignore_eos": True}
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(httpx.post, f"{base_url}/v1/completions", json=body, timeout=600)
        health = []
        while not future.done():
            health.append(httpx.get(f"{base_url}/health", timeout=30).status_code)
            time.sleep(0.5)
        response = future.result()
    assert health and set(health) == {200}, health
    assert response.status_code == 200, response.text[:300]
    result = response.json()
    assert sorted(c["index"] for c in result["choices"]) == list(range(512))
    assert result["usage"]["completion_tokens"] == 512 * 8


def test_slow_reading_stream_clients_are_served_to_the_end(base_url: str) -> None:
    """Four streams of 32 prompts each, read a line at a time with a pause between lines: every
    prompt runs to its 48th token, and another client is served meanwhile (the merge queue holds
    the engine streams back, it does not buffer them)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    body = {
        **COMP,
        "prompt": [f"Count to {i}:" for i in range(32)],
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def slow_reader(_: int) -> tuple[set[int], int, bool]:
        finished: set[int] = set()
        usage, done = 0, False
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                time.sleep(0.002)
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    finished |= {c["index"] for c in event["choices"] if c["finish_reason"]}
                    usage = (event.get("usage") or {}).get("completion_tokens", usage)
        return finished, usage, done

    with ThreadPoolExecutor(max_workers=4) as pool:
        readers = [pool.submit(slow_reader, i) for i in range(4)]
        response = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=600)
        assert response.status_code == 200, response.text
        results = [reader.result() for reader in readers]
    assert all(finished == set(range(32)) for finished, _, _ in results), results
    assert all(usage == 32 * 48 and done for _, usage, done in results), results


def test_file_download_is_streamed_from_disk(base_url: str) -> None:
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": COMP})
    content = ("\n".join([line] * 12_000) + "\n").encode()  # ~1.5 MiB.
    upload = httpx.post(
        f"{base_url}/v1/files",
        files={"file": ("big.jsonl", content)},
        data={"purpose": "batch"},
        timeout=120,
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    url = f"{base_url}/v1/files/{file_id}/content"
    with httpx.stream("GET", url, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-length"] == str(len(content))
        assert b"".join(response.iter_bytes()) == content
    assert httpx.delete(f"{base_url}/v1/files/{file_id}", timeout=60).status_code == 200
    gone = httpx.get(url, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


def test_router_memory_is_flat_after_every_hostile_case(base_url: str, rss_at_start: int) -> None:
    """Everything above (100k-field bodies, 512 prompts, slow streams, a download) leaves the
    router's resident memory where it started, give or take its allocator."""
    assert httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=120).status_code == 200
    assert router_rss() - rss_at_start < 64 * MiB
