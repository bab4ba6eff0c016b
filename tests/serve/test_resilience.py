"""Cancellation: a client that goes away frees its engine slot — checked on the engine itself."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx

from tests.serve.conftest import MODEL


def _engine_unfinished() -> int:
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name="llm")
    return int(handle.num_unfinished.remote().result(timeout_s=30))


async def _start_stream(http: httpx.AsyncClient, base_url: str, i: int) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Tell a very long story #{i}."}],
    }
    async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        received = 0
        async for line in response.aiter_lines():
            received += line.startswith("data: ")
            if received >= 3:
                return  # Leaving the block closes the connection mid-generation.


def test_cut_streams_free_engine_slots(base_url: str) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(_start_stream(http, base_url, i) for i in range(20)))

    asyncio.run(run())
    cut_at = time.monotonic()
    while _engine_unfinished() and time.monotonic() - cut_at < 10:
        time.sleep(0.1)
    freed_after = time.monotonic() - cut_at
    assert _engine_unfinished() == 0
    assert freed_after < 2.0, f"engine still busy {freed_after:.1f} s after the clients left"


def test_cut_non_streaming_request_frees_engine_slot(base_url: str) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
    }

    def call() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=4)

    caller = threading.Thread(target=call)
    caller.start()
    seen_running = False
    while caller.is_alive():
        seen_running = seen_running or _engine_unfinished() > 0
        time.sleep(0.2)
    cut_at = time.monotonic()
    assert seen_running, "the request never reached the engine"
    while _engine_unfinished() and time.monotonic() - cut_at < 10:
        time.sleep(0.1)
    assert _engine_unfinished() == 0
    assert time.monotonic() - cut_at < 2.0
