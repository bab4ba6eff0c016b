"""Competing tenants on the real graph: an app ("tenants") with keys, a 4-slot engine, the
operator's chat template, priority floors and token budgets per key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from serve_app import build_app
from tests.serve.conftest import MODEL

KEYS = {
    "heavy": "sk-heavy-5d1c0b9a8e7f",
    "light": "sk-light-2a3b4c5d6e7f",
    "ops": "sk-ops-9f8e7d6c5b4a",
    "metered": "sk-metered-1f2e3d4c5b6a",
}
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
SLOTS = 4
USER: list[Any] = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def tenants_url(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    folder = Path(tmp_path_factory.mktemp("tenants"))
    keys = folder / "api_keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    keys.chmod(0o600)
    template = folder / "chat.jinja"
    template.write_text(TEMPLATE)
    args: dict[str, Any] = {
        "model": {
            "name": MODEL,
            "max_model_len": 2048,
            "dtype": "auto",
            "chat_template": str(template),
        },
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
        "router": {"num_cpus": 0.05},
        "tracing": {"exporter": "memory"},
        "security": {
            "api_keys_file": str(keys),
            "key_priorities": {"ops": -10},
            "key_rate_limits": {"metered": {"tokens_per_minute": 1000}},
        },
    }
    serve.run(build_app(args), name="tenants", route_prefix="/tenants", blocking=False)
    url = f"{base_url}/tenants"
    deadline = time.monotonic() + 600
    while True:
        try:
            response = httpx.get(f"{url}/v1/models", headers=_auth("ops"), timeout=10)
            if response.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "tenants app not ready after 600 s"
        time.sleep(1)
    yield url
    serve.delete("tenants")


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def _client(url: str, name: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=KEYS[name], max_retries=0, timeout=300)


def test_the_operators_template_renders_every_chat(tenants_url: str) -> None:
    response = httpx.post(
        f"{tenants_url}/tokenize",
        headers=_auth("ops"),
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    text = httpx.post(
        f"{tenants_url}/detokenize",
        headers=_auth("ops"),
        json={"model": MODEL, "tokens": response.json()["tokens"]},
        timeout=60,
    ).json()["prompt"]
    assert text == "[user] Hello there\n[assistant] "
    chat = _client(tenants_url, "ops").chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2
    )
    assert chat.choices[0].finish_reason in ("length", "stop")


def _engine_spans(trace_ids: set[str]) -> dict[str, dict[str, Any]]:
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name="tenants")
    deadline = time.monotonic() + 30
    found: dict[str, dict[str, Any]] = {}
    while len(found) < len(trace_ids) and time.monotonic() < deadline:
        for span in handle.finished_spans.remote().result(timeout_s=30):
            if span["trace_id"] in trace_ids and span["name"] == "engine.generate":
                found[span["trace_id"]] = span["attributes"]
        time.sleep(0.5)
    return found


def test_priority_floors_per_key_and_the_tenant_reaches_the_engine(tenants_url: str) -> None:
    traces = {}
    for name, priority in (("ops", -5), ("ops", -50), ("heavy", -5), ("light", 3)):
        response = httpx.post(
            f"{tenants_url}/v1/completions",
            headers=_auth(name),
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "priority": priority},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        traces[response.headers["traceparent"].split("-")[1]] = (name, priority)
    spans = _engine_spans(set(traces))
    seen = {traces[t]: (s["serve_app.tenant"], s["serve_app.priority"]) for t, s in spans.items()}
    assert seen == {
        ("ops", -5): ("ops", -5),  # Allowed down to -10.
        ("ops", -50): ("ops", -10),
        ("heavy", -5): ("heavy", 0),  # Everyone else: 0 at best.
        ("light", 3): ("light", 3),
    }


def test_every_prompt_and_the_tools_are_charged(tenants_url: str) -> None:
    client = _client(tenants_url, "metered")
    # 64 prompts x 16 tokens = 1,088 tokens of a 1,000-token minute (charged once: 3 + 16).
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model=MODEL, prompt=["Hi."] * 64, max_tokens=16)
    assert error.value.body["type"] == "tokens"  # type: ignore[index]
    # ~4,400 characters of tool definitions: ~1,100 tokens before any prompt.
    tools: Any = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": "d" * 400, "parameters": {}},
        }
        for i in range(10)
    ]
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, tools=tools)
    # Within budget: served.
    assert client.completions.create(model=MODEL, prompt=["Hi."] * 8, max_tokens=4).choices


async def _stream(client: AsyncOpenAI, text: str, first: list[float], tokens: int) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first.append(time.monotonic())


def test_a_light_key_is_admitted_before_a_heavy_keys_queue(tenants_url: str) -> None:
    """The heavy key fills all 4 slots and queues 8 more; the light key's request takes the
    next free slot instead of waiting behind the 8 (vLLM alone: first come, first served)."""

    async def scenario() -> None:
        heavy = AsyncOpenAI(base_url=f"{tenants_url}/v1", api_key=KEYS["heavy"], max_retries=0)
        light = AsyncOpenAI(base_url=f"{tenants_url}/v1", api_key=KEYS["light"], max_retries=0)
        firsts: list[list[float]] = [[] for _ in range(3 * SLOTS)]
        flood = [
            asyncio.create_task(_stream(heavy, f"Tell a long story about ship {i}.", firsts[i], 48))
            for i in range(3 * SLOTS)
        ]
        deadline = time.monotonic() + 120
        while sum(map(bool, firsts)) < SLOTS and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        queued = [i for i, first in enumerate(firsts) if not first]
        assert len(queued) == 2 * SLOTS, "the heavy key should hold every slot, 8 queued"
        light_first: list[float] = []
        await _stream(light, "What is 2 + 2?", light_first, 4)
        await asyncio.gather(*flood)
        assert light_first and all(firsts)
        started_before = [i for i in queued if firsts[i][0] < light_first[0]]
        # At most those admitted in the same round (first come, first served: all 8).
        assert len(started_before) < SLOTS, (len(started_before), len(queued))

    asyncio.run(scenario())
