"""LoRA adapters from the config, served by name next to their base model (SmolLM2), on one engine
replica with one adapter slot (max_loras 1): vLLM swaps adapters between steps and batches base
requests with adapter requests. The adapters are built here, seeded random weights in PEFT's
format, so their answers differ from the base model's and from each other's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from serve_app import build_app
from serve_app.models import resolve_model
from serve_app.models.lora_adapter import build_lora_adapter
from tests.serve.wire import AsyncCheckedTransport, CheckedTransport

SMOL = "smollm2-135m-instruct"
PARIS = "What is the capital of France? Answer in one word."
ADAPTERS = {"sql-helper": 1, "poet": 2}  # Served name -> seed.
RUNTIME_SEED = 3  # The adapter loaded at runtime.


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = resolve_model(SMOL)
    where = tmp_path_factory.mktemp("adapters")
    seeds = ADAPTERS | {"runtime": RUNTIME_SEED}
    return {name: str(build_lora_adapter(base, where / name, seed=s)) for name, s in seeds.items()}


@pytest.fixture(scope="module")
def lora_url(base_url: str, adapter_dirs: dict[str, str]) -> Iterator[str]:
    from ray import serve

    from serve_app.launch import wait_ready

    adapters = {name: adapter_dirs[name] for name in ADAPTERS}
    app = build_app(
        {
            "model": {
                "name": SMOL,
                "max_model_len": 2048,
                "lora_adapters": adapters,
                "max_runtime_adapters": 2,
            },
            "engine": {
                "device": "cpu",
                "enforce_eager": True,
                "kv_cache_space_gib": 1,
                "block_size": 32,
                "max_num_seqs": 16,
                "num_cpus": 0.1,
                # One adapter per engine step: two adapters take turns.
                "vllm_args": {"max_loras": 1, "max_lora_rank": 8},
            },
            "preprocessor": {"num_cpus": 0.05},
            "router": {"num_cpus": 0.05},
        }
    )
    try:
        serve.run(app, name="lora", route_prefix="/lora", blocking=False)
        wait_ready(f"{base_url}/lora", timeout_s=600)
        yield f"{base_url}/lora"
    finally:  # Also when the deploy or a test failed.
        serve.delete("lora")


@pytest.fixture(scope="module")
def lora_client(lora_url: str) -> OpenAI:
    http = httpx.Client(transport=CheckedTransport(), timeout=120)
    return OpenAI(base_url=f"{lora_url}/v1", api_key="unused", max_retries=0, http_client=http)


def _answer(client: OpenAI, model: str, prompt: str = PARIS) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0,
    )
    assert response.model == model
    return response.choices[0].message.content or ""


def test_models_lists_the_adapters_with_their_base_as_parent(lora_client: OpenAI) -> None:
    cards = {card.id: card for card in lora_client.models.list().data}
    assert set(cards) == {SMOL, *ADAPTERS}
    for name in ADAPTERS:
        card = cards[name].model_dump()
        assert card["parent"] == SMOL
        assert card["root"].endswith(name)
        assert card["max_model_len"] == 2048
    assert cards[SMOL].model_dump().get("parent") is None


def test_each_adapter_answers_unlike_the_base_and_each_other(lora_client: OpenAI) -> None:
    base = _answer(lora_client, SMOL)
    assert "Paris" in base
    sql, poet = (_answer(lora_client, name) for name in ADAPTERS)
    assert len({base, sql, poet}) == 3, (base, sql, poet)
    assert "Paris" not in sql and "Paris" not in poet, (sql, poet)


async def test_base_and_two_adapters_at_once_on_one_lora_slot(lora_url: str) -> None:
    """Base requests share engine steps with adapter requests (vLLM's CPU ops once applied an
    adapter to them: serve_app.engine.cpu_lora_fix); the two adapters swap in one slot."""
    http = httpx.AsyncClient(transport=AsyncCheckedTransport(), timeout=300)
    client = AsyncOpenAI(base_url=f"{lora_url}/v1", api_key="-", max_retries=0, http_client=http)

    async def answer(model: str) -> tuple[str, str]:
        response = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PARIS}],
            max_tokens=8,
            temperature=0,
        )
        return model, response.choices[0].message.content or ""

    models = [SMOL, *ADAPTERS] * 4
    answers = await asyncio.gather(*(answer(model) for model in models))
    assert [model for model, _ in answers] == models
    for model, text in answers:
        if model == SMOL:
            assert "Paris" in text, answers
        else:
            assert "Paris" not in text, answers


def test_an_adapter_streams(lora_client: OpenAI) -> None:
    stream = lora_client.chat.completions.create(
        model="poet",
        messages=[{"role": "user", "content": "Write a line about the sea."}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"poet"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


def test_an_adapter_completes_and_follows_a_schema(lora_client: OpenAI) -> None:
    completion = lora_client.completions.create(
        model="sql-helper", prompt="SELECT name FROM", max_tokens=6, temperature=0
    )
    assert completion.model == "sql-helper"
    assert completion.choices[0].text
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response = lora_client.chat.completions.create(
        model="sql-helper",
        messages=[{"role": "user", "content": "Is water wet? Reply in JSON."}],
        max_tokens=20,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": schema, "strict": True},
        },
    )
    assert json.loads(response.choices[0].message.content or "")["answer"] in {"yes", "no"}


def test_an_unknown_adapter_is_404_naming_the_served_ones(lora_client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        _answer(lora_client, "sql-helper-v2")
    message = caught.value.response.json()["error"]["message"]
    assert all(name in message for name in (SMOL, *ADAPTERS))


def test_an_adapter_loaded_at_runtime_is_served_until_unloaded(
    lora_url: str, lora_client: OpenAI, adapter_dirs: dict[str, str]
) -> None:
    """vLLM's routes and bodies: load, use, a second load of the name, unload, and a 404 after."""
    http = httpx.Client(base_url=lora_url, timeout=120)
    body = {"lora_name": "support-tone", "lora_path": adapter_dirs["runtime"]}
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert "added successfully" in loaded.text
    cards = {card.id: card.model_dump() for card in lora_client.models.list().data}
    assert cards["support-tone"]["parent"] == SMOL
    answer = _answer(lora_client, "support-tone")
    assert "Paris" not in answer and answer != _answer(lora_client, "sql-helper")
    again = http.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    missing = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/nonexistent/lora"}
    )
    assert missing.status_code in (400, 404), missing.text
    assert missing.json()["error"]["param"] == "lora_path"
    assert "gone" not in {card.id for card in lora_client.models.list().data}
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "support-tone"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        _answer(lora_client, "support-tone")
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "support-tone"})
    assert gone.status_code == 404
    configured = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    assert configured.status_code == 400 and "model.lora_adapters" in configured.text
