"""Two models behind one router (`models:`), each with its own preprocessor and engine: SmolLM2
and the Qwen2 code path, tiny-qwen2 (random weights, Qwen2.5 ChatML template) on the
multi-worker engine path: tensor parallel 2, one model worker per rank (vLLM CPU has no Ray
executor: "current platform cpu does not support ray"; it runs its multiprocessing one)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from serve_app import build_app
from serve_app.models import resolve_model
from tests.serve.wire import CheckedTransport

QWEN = "tiny-qwen2"
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def qwen_client(base_url: str) -> Iterator[OpenAI]:
    from ray import serve

    from serve_app.launch import wait_ready

    app = build_app(
        {
            # Every model's defaults; each entry overrides them key by key.
            "engine": {
                "device": "cpu",
                "enforce_eager": True,
                "kv_cache_space_gib": 1,
                "max_num_seqs": 16,
                "num_cpus": 0.1,
            },
            "preprocessor": {"num_cpus": 0.05},
            "models": [
                {
                    # As in serve_config.cpu.yaml (its answers are the shared app's), smaller.
                    "model": {"name": SMOL, "max_model_len": 2048},
                    "engine": {"block_size": 32},
                },
                {
                    "model": {"name": QWEN, "max_model_len": 2048},
                    # tiny-qwen2: 2 heads, 1 KV head (replicated).
                    "engine": {"tensor_parallel_size": 2, "num_cpus": 0.2},
                },
            ],
            "router": {"num_cpus": 0.05},
            "batch_api": {"enabled": False},  # Not under test here: one process less.
        }
    )
    try:
        serve.run(app, name="qwen", route_prefix="/qwen", blocking=False)
        wait_ready(f"{base_url}/qwen", timeout_s=600)
        yield OpenAI(
            base_url=f"{base_url}/qwen/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.Client(transport=CheckedTransport(), timeout=120),
        )
    finally:  # Also when the deploy or a test failed.
        serve.delete("qwen")


def test_qwen2_chat_uses_the_chatml_template(qwen_client: OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
    ]
    response = qwen_client.chat.completions.create(
        model=QWEN,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(QWEN))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert rendered.endswith("<|im_start|>assistant\n")
    expected_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    usage = response.usage
    assert usage is not None and usage.prompt_tokens == len(expected_ids)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert usage.completion_tokens == 8 or response.choices[0].finish_reason == "stop"


def test_qwen2_default_system_prompt_and_streaming(qwen_client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(QWEN))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "You are Qwen, created by Alibaba Cloud." in rendered
    stream = qwen_client.chat.completions.create(
        model=QWEN,
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_qwen2_serves_with_tensor_parallel_2(qwen_client: OpenAI) -> None:
    """Two model workers, each with its own core list, serve one engine (vLLM's TP=2 path:
    weights sharded, an all-reduce per layer), answering through the graph like TP=1."""
    import psutil
    from ray import serve

    handle = serve.get_deployment_handle(f"Engine-{QWEN}", app_name="qwen")
    args = handle.engine_args.remote().result(timeout_s=60)
    assert args["tensor_parallel_size"] == 2
    from tests.serve.test_scale_survive import _replica_pids

    (replica,) = _replica_pids("qwen", f"Engine-{QWEN}")
    workers = [
        p
        for p in psutil.Process(replica).children(recursive=True)
        if "VLLM::Worker" in " ".join([p.name(), *p.cmdline()])
    ]
    assert len(workers) == 2, [(p.pid, p.name()) for p in workers]
    completion = qwen_client.completions.create(model=QWEN, prompt="Hello", max_tokens=8)
    assert completion.usage is not None and completion.usage.completion_tokens >= 1


def test_each_model_answers_by_its_own_name(qwen_client: OpenAI) -> None:
    """One router, two models: /v1/models lists both; each request reaches its own model's
    tokenizer and engine (SmolLM2 knows capitals, random-weight tiny-qwen2 does not; the two
    vocabularies give the same text different tokens)."""
    listed = {card.id: card.model_dump() for card in qwen_client.models.list().data}
    assert set(listed) == {SMOL, QWEN}
    assert listed[SMOL]["max_model_len"] == listed[QWEN]["max_model_len"] == 2048
    answers = {
        model: qwen_client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=5, temperature=0
        )
        for model in (SMOL, QWEN)
    }
    assert {model: answer.model for model, answer in answers.items()} == {SMOL: SMOL, QWEN: QWEN}
    assert "Paris" in answers[SMOL].choices[0].text
    assert "Paris" not in answers[QWEN].choices[0].text
    app_url = str(qwen_client.base_url).rstrip("/").removesuffix("/v1")
    tokens = {
        model: httpx.post(
            f"{app_url}/tokenize", json={"model": model, "prompt": "Hello world"}, timeout=60
        ).json()["tokens"]
        for model in (SMOL, QWEN)
    }
    expected = {
        model: AutoTokenizer.from_pretrained(resolve_model(model))("Hello world")["input_ids"]
        for model in (SMOL, QWEN)
    }
    assert tokens == expected and tokens[SMOL] != tokens[QWEN]


def test_both_models_stream_and_an_unknown_one_is_named(qwen_client: OpenAI) -> None:
    for model in (SMOL, QWEN):
        stream = qwen_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name a colour. Answer in one word."}],
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert {chunk.model for chunk in chunks} == {model}
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens >= 1
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    with pytest.raises(openai.NotFoundError) as caught:
        qwen_client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert SMOL in error["message"] and QWEN in error["message"]
