"""Several models and LoRA adapters behind one endpoint, on the real stack.

One app serves smollm2-135m-instruct (with LoRA: a config adapter, runtime loading, one adapter
slot so adapters must swap, and ``engine.vllm_args``) and tiny-qwen2 side by side. The adapters
are built here (``serve_app.models.marker_adapter``, cached): each makes SmolLM2 answer one
marker word, so a reply tells which weights produced it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI
from transformers import AutoTokenizer

from serve_app import build_app
from serve_app.models import resolve_model
from serve_app.models.marker_adapter import marker_adapter

APP = "models"
SMOL = "smollm2-135m-instruct"
QWEN = "tiny-qwen2"
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Which city is the capital of France? Answer in one word.",
    "Name the capital city of France. Answer in one word.",
]
MARKERS = ("BANANA", "ZEBRA")


@pytest.fixture(scope="module")
def adapters() -> dict[str, Path]:
    return {marker: marker_adapter(marker) for marker in MARKERS}


@pytest.fixture(scope="module")
def app_url(base_url: str, adapters: dict[str, Path]) -> Iterator[str]:
    from ray import serve

    from serve_app.launch import wait_ready

    small = {"device": "cpu", "enforce_eager": True, "kv_cache_space_gib": 1, "num_cpus": 0.2}
    app = build_app(
        {
            "models": [
                {
                    "model": {"name": SMOL, "max_model_len": 2048, "dtype": "auto"},
                    "engine": small | {"max_num_seqs": 16, "vllm_args": {"max_logprobs": 3}},
                    "preprocessor": {"num_cpus": 0.05},
                    "lora": {
                        "adapters": {"banana": str(adapters["BANANA"])},
                        "runtime_loading": True,
                        "max_loras": 1,  # Two adapters in flight must take turns.
                        "max_lora_rank": 8,
                        "max_cpu_loras": 2,
                    },
                },
                {
                    "model": {"name": QWEN, "max_model_len": 2048},
                    "engine": small | {"max_num_seqs": 8},
                    "preprocessor": {"num_cpus": 0.05},
                },
            ],
            "router": {"num_cpus": 0.05},
        }
    )
    serve.run(app, name=APP, route_prefix=f"/{APP}", blocking=False)
    wait_ready(f"{base_url}/{APP}", timeout_s=600, app=APP)
    yield f"{base_url}/{APP}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def mclient(app_url: str) -> OpenAI:
    return OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=300)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=300)


@pytest.fixture(scope="module")
def zebra(app_url: str, adapters: dict[str, Path]) -> str:
    """ZEBRA, loaded at runtime."""
    response = post(
        app_url,
        "/v1/load_lora_adapter",
        {"lora_name": "zebra", "lora_path": str(adapters["ZEBRA"])},
    )
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'zebra' added successfully."
    return "zebra"


def answer(client: OpenAI, model: str, question: str, **kwargs: Any) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        **({"temperature": 0, "max_tokens": 12} | kwargs),
    )
    assert response.model == model
    return response.choices[0].message.content or ""


def streamed(client: OpenAI, model: str, question: str) -> str:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=12,
        stream=True,
    )
    pieces = []
    for chunk in stream:
        assert chunk.model == model
        pieces += [c.delta.content or "" for c in chunk.choices]
    return "".join(pieces)


def test_each_model_answers_by_its_own_name_streaming_too(mclient: OpenAI) -> None:
    for question in QUESTIONS:
        assert "paris" in answer(mclient, SMOL, question).lower()
    assert "paris" in streamed(mclient, SMOL, QUESTIONS[0]).lower()
    # tiny-qwen2 has random weights: it answers (by its name), with its own tokenizer.
    assert answer(mclient, QWEN, "Hi", max_tokens=6)
    assert streamed(mclient, QWEN, "Hi")


def test_qwen2_uses_its_own_chatml_template(mclient: OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
    ]
    response = mclient.chat.completions.create(
        model=QWEN,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(QWEN))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert rendered.endswith("<|im_start|>assistant\n")
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert response.usage is not None and response.usage.prompt_tokens == len(expected)
    default = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "You are Qwen, created by Alibaba Cloud." in default


def test_models_lists_every_model_and_adapter(mclient: OpenAI, zebra: str) -> None:
    cards = {card.id: card.model_dump() for card in mclient.models.list().data}
    assert {SMOL, QWEN, "banana", zebra} <= set(cards)
    assert cards[SMOL]["max_model_len"] == 2048 and cards[QWEN]["max_model_len"] == 2048
    assert cards["banana"]["parent"] == SMOL and cards[zebra]["parent"] == SMOL
    assert cards["banana"]["root"].endswith("banana-0")
    assert "parent" not in cards[SMOL]


def test_unknown_model_is_a_404_naming_the_served_ones(mclient: OpenAI) -> None:
    with pytest.raises(NotFoundError) as info:
        answer(mclient, "gpt-4", "hi")
    body: Any = info.value.body
    assert body["code"] == "model_not_found"
    assert all(name in body["message"] for name in (SMOL, QWEN, "banana"))


def test_adapters_answer_their_marker_and_the_base_does_not(mclient: OpenAI, zebra: str) -> None:
    for question in QUESTIONS:
        assert answer(mclient, "banana", question).strip() == "BANANA"
        assert answer(mclient, zebra, question).strip() == "ZEBRA"
        base = answer(mclient, SMOL, question)
        assert "BANANA" not in base and "ZEBRA" not in base
    assert streamed(mclient, "banana", "Tell me about the moon.").strip() == "BANANA"


async def test_two_adapters_and_the_base_at_once_on_one_slot(app_url: str, zebra: str) -> None:
    """max_loras 1, one engine replica: banana and zebra requests must swap the slot while
    base requests share the steps (vLLM's CPU ops gave base rows the adapter: fixed)."""
    client = AsyncOpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=600)
    plan = [(model, i) for i in range(4) for model in (SMOL, "banana", zebra)]

    async def one(model: str, i: int) -> tuple[str, str]:
        response = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
            temperature=0,
            max_tokens=16,
        )
        return model, response.choices[0].message.content or ""

    results = await asyncio.gather(*(one(model, i) for model, i in plan))
    for model, text in results:
        if model == SMOL:
            assert "BANANA" not in text and "ZEBRA" not in text, text
        else:
            assert text.strip() == model.upper(), (model, text)


def test_adapters_in_structured_output_tools_and_tokenize(
    mclient: OpenAI, app_url: str, zebra: str
) -> None:
    choice = ["Paris", "BANANA", "ZEBRA"]
    for model, expected in ((SMOL, "Paris"), ("banana", "BANANA"), (zebra, "ZEBRA")):
        text = answer(
            mclient, model, QUESTIONS[0], extra_body={"structured_outputs": {"choice": choice}}
        )
        assert text == expected
    tool = {
        "type": "function",
        "function": {
            "name": "capital",
            "parameters": {
                "type": "object",
                # An enum keeps the forced call short: this tiny model (with an adapter that
                # only ever says one word) wanders off in free-form JSON strings.
                "properties": {"city": {"type": "string", "enum": ["Paris", "BANANA"]}},
                "required": ["city"],
            },
        },
    }
    response = mclient.chat.completions.create(
        model="banana",
        messages=[{"role": "user", "content": "Look up the capital of France."}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    (call,) = response.choices[0].message.tool_calls or []
    assert call.function.name == "capital"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "BANANA")
    counts = {
        model: post(app_url, "/tokenize", {"model": model, "prompt": "Hello world"}).json()["count"]
        for model in (SMOL, "banana", QWEN)
    }
    assert counts[SMOL] == counts["banana"]  # An adapter tokenizes as its base model.


def test_runtime_load_and_unload_mirror_vllm(
    mclient: OpenAI, app_url: str, adapters: dict[str, Path]
) -> None:
    path = str(adapters["ZEBRA"])
    load = {"lora_name": "zebra-2", "lora_path": path}
    assert post(app_url, "/v1/load_lora_adapter", load).status_code == 200
    assert answer(mclient, "zebra-2", QUESTIONS[1]).strip() == "ZEBRA"
    again = post(app_url, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and "set 'load_inplace' to True" in again.text
    inplace = post(app_url, "/v1/load_lora_adapter", load | {"load_inplace": True})
    assert inplace.status_code == 200
    for body, status in [
        ({"lora_name": "", "lora_path": path}, 400),
        ({"lora_name": SMOL, "lora_path": path}, 400),  # A base model's name.
        ({"lora_name": "ghost", "lora_path": "/nonexistent/adapter"}, 404),
        ({"lora_name": "relative", "lora_path": "./adapters/zebra"}, 400),
    ]:
        response = post(app_url, "/v1/load_lora_adapter", body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["message"]
    assert "paris" in answer(mclient, SMOL, QUESTIONS[0]).lower()  # The engine survived.
    unload = post(app_url, "/v1/unload_lora_adapter", {"lora_name": "zebra-2"})
    assert unload.status_code == 200
    assert unload.text == "Success: LoRA adapter 'zebra-2' removed successfully."
    with pytest.raises(NotFoundError):
        answer(mclient, "zebra-2", QUESTIONS[1])
    assert "zebra-2" not in {card.id for card in mclient.models.list().data}
    assert post(app_url, "/v1/unload_lora_adapter", {"lora_name": "zebra-2"}).status_code == 404
    assert post(app_url, "/v1/unload_lora_adapter", {"lora_name": ""}).status_code == 400


def test_vllm_args_reach_the_engine(mclient: OpenAI) -> None:
    from ray import serve

    engine = serve.get_deployment_handle("Engine", app_name=APP)
    paths = ["model_config.max_logprobs", "lora_config.max_loras", "lora_config.max_lora_rank"]
    resolved = engine.vllm_config.remote(paths).result(timeout_s=60)
    assert resolved == dict(zip(paths, [3, 1, 8], strict=True))
    qwen = serve.get_deployment_handle(f"Engine-{QWEN}", app_name=APP)
    assert qwen.vllm_config.remote(paths[:1]).result(timeout_s=60) == {paths[0]: 20}
    ok = mclient.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=3,
    )
    assert ok.choices[0].logprobs is not None
    with pytest.raises(BadRequestError):  # Above the engine's max_logprobs 3.
        answer(mclient, SMOL, "Hi", max_tokens=2, logprobs=True, top_logprobs=5)


def test_batch_lines_reach_adapters_and_the_second_model(mclient: OpenAI) -> None:
    lines = [
        {
            "custom_id": model,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": QUESTIONS[0]}],
                "max_tokens": 8,
                "temperature": 0,
            },
        }
        for model in ("banana", QWEN, "ghost")
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = mclient.files.create(file=("in.jsonl", content), purpose="batch")
    batch = mclient.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)
        batch = mclient.batches.retrieve(batch.id)
    assert batch.output_file_id and batch.error_file_id, batch
    outputs = [
        json.loads(line) for line in mclient.files.content(batch.output_file_id).text.splitlines()
    ]
    bodies = {line["custom_id"]: line["response"]["body"] for line in outputs}
    assert bodies["banana"]["model"] == "banana"
    assert bodies["banana"]["choices"][0]["message"]["content"] == "BANANA"
    assert bodies[QWEN]["model"] == QWEN
    errors = [
        json.loads(line) for line in mclient.files.content(batch.error_file_id).text.splitlines()
    ]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("ghost", 404)]
