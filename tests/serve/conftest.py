"""Serve tier: the real app (Ray Serve + vLLM CPU + the real SmolLM2 model), once per session."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from serve_app.launch import load_serve_config, start, wait_ready
from tests.serve.wire import AsyncCheckedTransport, CheckedTransport

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
APP = "llm"  # The application's name in serve_config.cpu.yaml.


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/serve" in str(item.fspath):
            item.add_marker(pytest.mark.serve)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def base_url() -> Iterator[str]:
    """The CPU serve config as shipped, on a free loopback port."""
    import ray
    from ray import serve

    config = load_serve_config(ROOT / "serve_config.cpu.yaml")
    # A smaller KV cache than `make serve` keeps room for a second engine (tiny-qwen2); every
    # test runs with tracing on (in-memory spans), so tracing is exercised on every path.
    # inject_faults: test_errors provokes one. vllm_args: an engine option passed through as
    # is (vLLM's default max_logprobs is 20), read back by test_openai_api; text is unchanged.
    overrides = {
        "engine": {
            "kv_cache_space_gib": 1,
            "inject_faults": True,
            "vllm_args": {"max_logprobs": 25},
        },
        "tracing": {"exporter": "memory"},
        # Probes poll at most twice a second; test_hostile_input floods /health past it.
        "security": {"open_paths_per_second": 5},
    }
    try:
        urls = start(config, port=_free_port(), overrides=overrides)
        wait_ready(urls[0], timeout_s=600)
        yield urls[0]
    finally:  # Also when start-up or a test failed: nothing left for the next tier.
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        _reap_children()


def _reap_children() -> None:
    """Ends what Ray or vLLM left behind under this pytest process (a replica's engine core)."""
    import psutil

    leftovers = psutil.Process().children(recursive=True)
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(leftovers, timeout=10)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


@pytest.fixture(scope="session")
def client(base_url: str) -> OpenAI:
    # Every body this client receives is checked against the SDK's types in strict mode.
    http = httpx.Client(transport=CheckedTransport(), timeout=300)
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)


@pytest.fixture
def async_client(base_url: str) -> AsyncOpenAI:
    http = httpx.AsyncClient(transport=AsyncCheckedTransport(), timeout=600)
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)
