"""API keys and rate limits on the real graph: a second app ("secure") with keys, two routers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from serve_app import build_app
from tests.serve.conftest import MODEL
from tests.serve.wire import CheckedTransport

ADMIN = "sk-admin-4c1f0e8a9b7d"
LIMITED = "sk-limited-77e2a1c05f3b"
TOKENS = "sk-tokens-0a9e5d3c2b1f"
HEAVY = "sk-heavy-5d1c0b9a8e7f"
LIGHT = "sk-light-2a3b4c5d6e7f"
SLOTS = 16  # The engine's max_num_seqs.
RPM = 6
OPEN = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def secure_url(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    keys = Path(tmp_path_factory.mktemp("keys")) / "api_keys"
    keys.write_text(
        f"admin:{ADMIN}\nlimited:{LIMITED}\ntokens:{TOKENS}\nheavy:{HEAVY}\nlight:{LIGHT}\n"
    )
    keys.chmod(0o600)
    args: dict[str, Any] = {
        "model": {"name": MODEL, "max_model_len": 2048, "dtype": "auto"},
        "engine": {
            "device": "cpu",
            "enforce_eager": True,
            "kv_cache_space_gib": 1,
            "block_size": 32,
            "max_num_seqs": SLOTS,
            "num_cpus": 0.2,
            "fair_share": {"weights": {"light": 2}},
        },
        "preprocessor": {"num_cpus": 0.05},
        "router": {"num_cpus": 0.05, "num_replicas": 2},
        "sse_keepalive_s": 1,  # Queued streams here wait seconds: they must see comments.
        "security": {
            "api_keys_file": str(keys),
            "key_rate_limits": {
                "limited": {"requests_per_minute": RPM},
                "tokens": {"tokens_per_minute": 100},
            },
            "limits": {"max_n": 2, "max_tokens_cap": 64},
            "key_priorities": {"admin": -10},
        },
    }
    try:
        yield _deploy_secure(args, f"{base_url}/secure")
    finally:  # Also when the deploy or a test failed.
        serve.delete("secure")


def _deploy_secure(args: dict[str, Any], url: str) -> str:
    from ray import serve

    serve.run(build_app(args), name="secure", route_prefix="/secure", blocking=False)
    deadline = time.monotonic() + 600
    while True:
        try:
            response = httpx.get(f"{url}/v1/models", headers=_auth(ADMIN), timeout=10)
            if response.status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "secure app not ready after 600 s"
        time.sleep(1)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _client(url: str, key: str) -> OpenAI:
    return OpenAI(
        base_url=f"{url}/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.Client(transport=CheckedTransport(), timeout=300),
    )


def test_every_route_needs_a_key(secure_url: str) -> None:
    spec = httpx.get(f"{secure_url}/openapi.json", timeout=30).json()  # Open, like /health.
    routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops if p not in OPEN]
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/v1/models") in routes
    for method, path in [*routes, ("GET", "/v1/does-not-exist")]:
        for headers in ({}, _auth("sk-wrong-0000000000"), {"Authorization": f"Basic {ADMIN}"}):
            response = httpx.request(method, f"{secure_url}{path}", headers=headers, timeout=30)
            assert response.status_code == 401, (method, path, response.text)
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    for path in ("/health", "/openapi.json", "/docs"):
        assert httpx.get(f"{secure_url}{path}", timeout=30).status_code == 200, path


def test_openai_client_wrong_key_is_authentication_error(secure_url: str) -> None:
    client = _client(secure_url, "sk-wrong-0000000000")
    with pytest.raises(openai.AuthenticationError) as error:
        client.models.list()
    assert error.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_openai_client_right_key_works_on_every_route(secure_url: str) -> None:
    client = _client(secure_url, ADMIN)
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert chat.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4)
    assert text.choices[0].text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # Keys never reach the app's own errors: a bad request with a good key is a plain 400.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=9)


def test_batch_api_files_and_batches_belong_to_their_key(secure_url: str) -> None:
    """Another key gets 404 on a key's files and batches (read, content, cancel, delete) and
    never lists them; the owner reads, lists and downloads its output (openai client). A line
    beyond the request limits (max_tokens_cap 64) is an error line; the other line runs."""
    import io
    import json

    owner, other = _client(secure_url, ADMIN), _client(secure_url, LIGHT)
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": USER, "max_tokens": max_tokens},
        }
        for custom_id, max_tokens in (("only", 4), ("over-cap", 1000))
    ]
    upload = io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    file = owner.files.create(file=("in.jsonl", upload), purpose="batch")
    batch = owner.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: other.files.retrieve(file.id),
        lambda: other.files.content(file.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.delete(file.id),
        lambda: other.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in other.batches.list()]
    assert batch.id in [b.id for b in owner.batches.list()]
    deadline = time.monotonic() + 180
    while (batch := owner.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(1)
    assert batch.output_file_id is not None and batch.error_file_id is not None
    assert batch.request_counts is not None and batch.request_counts.failed == 1
    result = json.loads(owner.files.content(batch.output_file_id).text)
    assert result["custom_id"] == "only" and result["response"]["status_code"] == 200
    failed = json.loads(owner.files.content(batch.error_file_id).text)
    assert failed["custom_id"] == "over-cap" and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["param"] == "max_tokens"
    for output in (batch.output_file_id, batch.error_file_id):
        with pytest.raises(openai.NotFoundError):
            other.files.content(output)
    assert owner.files.retrieve(file.id).id == file.id  # The other key's delete did nothing.


def test_rate_limit_holds_across_two_router_replicas(secure_url: str) -> None:
    import ray
    from ray import serve

    routers = serve.status().applications["secure"].deployments["Router"].replica_states
    assert sum(n for state, n in routers.items() if state == "RUNNING") == 2, routers
    # One limiter for the whole app, whichever replica created it.
    assert ray.get_actor("serve_app_rate_limiter.secure", namespace="serve_app")
    client = _client(secure_url, LIMITED)

    def one(_: int) -> int | str:
        try:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
            return 200
        except openai.RateLimitError as exc:
            assert exc.code == "rate_limit_exceeded"
            assert exc.body and exc.body["type"] == "requests"  # type: ignore[index]
            return exc.response.headers["retry-after"]

    # Concurrent, so the proxy spreads them over both router replicas.
    with ThreadPoolExecutor(max_workers=2 * RPM) as pool:
        results = list(pool.map(one, range(2 * RPM)))
    assert results.count(200) == RPM, results
    retry_after = [int(r) for r in results if r != 200]
    assert len(retry_after) == RPM and all(1 <= r <= 60 for r in retry_after), results
    # Other keys keep their own budgets.
    assert _client(secure_url, ADMIN).models.list().data


def test_token_budget_charges_max_tokens_up_front(secure_url: str) -> None:
    client = _client(secure_url, TOKENS)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=60)  # 1 + 60 of 100.
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=60)
    assert error.value.body["type"] == "tokens"  # type: ignore[index]
    assert int(error.value.response.headers["retry-after"]) >= 1


def test_request_limits_apply_through_the_router(secure_url: str) -> None:
    client = _client(secure_url, ADMIN)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=USER, n=3, max_tokens=2)
    assert (error.value.param, error.value.code) == ("n", "integer_above_max_value")
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=65)
    assert (error.value.param, error.value.code) == ("max_tokens", "integer_above_max_value")


def test_priority_floor_per_key(secure_url: str) -> None:
    """A key listed in security.key_priorities may run below 0, down to its floor; a lower ask
    is raised to the floor and served (keys without a floor: test_hostile_input)."""
    admin = _client(secure_url, ADMIN)
    for priority in (-11, -10, 0, 100):
        chat = admin.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, extra_body={"priority": priority}
        )
        assert chat.choices[0].finish_reason in ("length", "stop")


def test_every_prompt_is_charged_its_budget(secure_url: str) -> None:
    """4 prompts × max_tokens 30 need 124 tokens, more than the key's 100 per minute: refused
    outright (before, the budget was charged once: 34 tokens)."""
    client = _client(secure_url, TOKENS)
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model=MODEL, prompt=["a", "b", "c", "d"], max_tokens=30)
    assert error.value.body["type"] == "tokens"  # type: ignore[index]
    assert "it needs 124 tokens" in error.value.message
    assert "retry-after" not in error.value.response.headers


async def _stream(client: AsyncOpenAI, prompt: str, max_tokens: int, firsts: list[float]) -> None:
    """A streamed chat; appends when its first token arrived (monotonic clock)."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if not firsts and chunk.choices and chunk.choices[0].delta.content:
            firsts.append(time.monotonic())


def test_a_light_key_is_admitted_before_a_heavy_keys_queue(secure_url: str) -> None:
    """Fair share: the heavy key holds all 16 slots with 48 more requests waiting; the light
    key's request takes one of the next free slots instead of waiting behind the 48 (vLLM
    alone serves first come, first served: every waiting heavy request would start first)."""

    async def scenario() -> None:
        heavy = AsyncOpenAI(base_url=f"{secure_url}/v1", api_key=HEAVY, max_retries=0)
        light = AsyncOpenAI(base_url=f"{secure_url}/v1", api_key=LIGHT, max_retries=0)
        firsts: list[list[float]] = [[] for _ in range(4 * SLOTS)]
        flood = [
            asyncio.create_task(_stream(heavy, f"Tell a long story about ship {i}.", 48, first))
            for i, first in enumerate(firsts)
        ]
        deadline = time.monotonic() + 300
        while sum(map(bool, firsts)) < SLOTS and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        waiting = [first for first in firsts if not first]
        light_first: list[float] = []
        await _stream(light, "What is 2 + 2?", 4, light_first)
        await asyncio.gather(*flood)
        assert light_first and all(firsts)
        assert len(waiting) >= 2 * SLOTS, len(waiting)  # First come, first served: all first.
        started_before = sum(1 for first in waiting if first[0] < light_first[0])
        # One on vLLM's deck, and at most the others admitted in the light request's round.
        assert started_before <= SLOTS + 1, (started_before, len(waiting))

    asyncio.run(scenario())


def test_a_queued_stream_gets_keepalive_comments_then_its_answer(secure_url: str) -> None:
    """A stream queued behind two rounds of a full engine says nothing for seconds: its
    headers go out after sse_keepalive_s (1 s here) with a comment line, a comment follows
    every silent second, and then its events come as usual, ending in [DONE]."""

    async def scenario() -> list[str]:
        heavy = AsyncOpenAI(base_url=f"{secure_url}/v1", api_key=HEAVY, max_retries=0)
        firsts: list[list[float]] = [[] for _ in range(3 * SLOTS)]
        flood = [
            asyncio.create_task(_stream(heavy, f"Tell a long story about ship {i}.", 48, first))
            for i, first in enumerate(firsts)
        ]
        deadline = time.monotonic() + 300
        while sum(map(bool, firsts)) < SLOTS and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 8,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {HEAVY}"}
        async with (
            httpx.AsyncClient(timeout=300) as http,
            http.stream(
                "POST", f"{secure_url}/v1/chat/completions", json=body, headers=headers
            ) as response,
        ):
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        await asyncio.gather(*flood)
        return lines

    lines = asyncio.run(scenario())
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    print(f"\n{first_data} keep-alive comments before the first event")
    assert first_data >= 1 and set(lines[:first_data]) == {": keep-alive"}, lines[:5]
    assert lines[-1] == "data: [DONE]"
    events = [line for line in lines if line.startswith("data: ")]
    assert len(events) >= 3 and not any('"error"' in event for event in events), events
