"""The Qwen2 code path: tiny-qwen2 (random weights, Qwen2.5 ChatML template) through the graph,
on the multi-worker engine path: tensor parallel 2, one model worker per rank (vLLM CPU has
no Ray executor: "current platform cpu does not support ray"; it runs its multiprocessing one)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from serve_app import build_app
from serve_app.models import resolve_model
from tests.serve.wire import CheckedTransport

QWEN = "tiny-qwen2"


@pytest.fixture(scope="module")
def qwen_client(base_url: str) -> Iterator[OpenAI]:
    from ray import serve

    from serve_app.launch import wait_ready

    app = build_app(
        {
            "model": {"name": QWEN, "max_model_len": 2048},
            "engine": {
                "device": "cpu",
                "enforce_eager": True,
                "kv_cache_space_gib": 1,
                "max_num_seqs": 16,
                "num_cpus": 0.2,
                "tensor_parallel_size": 2,  # tiny-qwen2: 2 heads, 1 KV head (replicated).
            },
            "preprocessor": {"num_cpus": 0.05},
            "router": {"num_cpus": 0.05},
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

    handle = serve.get_deployment_handle("Engine", app_name="qwen")
    args = handle.engine_args.remote().result(timeout_s=60)
    assert args["tensor_parallel_size"] == 2
    from tests.serve.test_scale_survive import _replica_pids

    (replica,) = _replica_pids("qwen", "Engine")
    workers = [
        p
        for p in psutil.Process(replica).children(recursive=True)
        if "VLLM::Worker" in " ".join([p.name(), *p.cmdline()])
    ]
    assert len(workers) == 2, [(p.pid, p.name()) for p in workers]
    completion = qwen_client.completions.create(model=QWEN, prompt="Hello", max_tokens=8)
    assert completion.usage is not None and completion.usage.completion_tokens >= 1
