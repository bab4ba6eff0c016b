"""Graceful shutdown: deleting an app mid-generation lets in-flight requests finish in full."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx

from tests.serve.conftest import MODEL
from tests.serve.test_scale_survive import SURVIVE, _deploy

MAX_TOKENS = 100
STREAMS = 16
# SURVIVE's replicas, but room for every stream at once (its 4 + 4 slots would shed 8 of 16),
# a request timeout longer than the drain, and drains that cover it (as serve_config.yaml does).
DRAIN: dict[str, Any] = {
    "engine": SURVIVE["engine"]
    | {
        "max_ongoing_requests": 32,
        "max_queued_requests": 16,
        "stall_timeout_s": 60,
        "graceful_shutdown_timeout_s": 300,
    },
    "router": SURVIVE["router"] | {"graceful_shutdown_timeout_s": 300},
    "preprocessor": SURVIVE["preprocessor"] | {"graceful_shutdown_timeout_s": 300},
    "batch_api": SURVIVE["batch_api"],
    "request_timeout_s": 300,
    "engine_wait_timeout_s": 30,
}


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "messages": [{"role": "user", "content": f"Tell a long story about ship {i}."}],
    }


async def _stream(http: httpx.AsyncClient, url: str, i: int, started: asyncio.Event) -> Any:
    """(finish reason, completion tokens, saw [DONE]) of one streamed answer."""
    finish, tokens, done = None, 0, False
    async with http.stream("POST", f"{url}/v1/chat/completions", json=_body(i, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                started.set()
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return finish, tokens, done


async def _plain(http: httpx.AsyncClient, url: str, i: int) -> Any:
    r = await http.post(f"{url}/v1/chat/completions", json=_body(i, False))
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"], True


def _delete(app: str, timeout_s: float) -> None:
    """serve.delete, waiting up to timeout_s: its own wait gives up after 60 s, and on a busy
    2-core machine the engine replica's shutdown (after the drain) has come close to that."""
    from ray import serve

    serve.delete(app, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while app in serve.status().applications:
        assert time.monotonic() < deadline, f"{app} still exists {timeout_s:.0f} s after delete"
        time.sleep(1)


def test_delete_drains_in_flight_requests(base_url: str) -> None:

    url = _deploy(base_url, "drain", DRAIN)
    deleted = threading.Event()

    async def run() -> tuple[list[Any], float]:
        limits = httpx.Limits(max_connections=STREAMS + 4)
        async with httpx.AsyncClient(timeout=400, limits=limits) as http:
            events = [asyncio.Event() for _ in range(STREAMS)]
            tasks = [asyncio.create_task(_stream(http, url, i, e)) for i, e in enumerate(events)]
            tasks.append(asyncio.create_task(_plain(http, url, STREAMS)))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 240)
            # Every stream is mid-generation: shut the app down under them.
            begun = time.monotonic()
            deleter = threading.Thread(target=lambda: (_delete("drain", 300), deleted.set()))
            deleter.start()
            results = await asyncio.gather(*tasks)
            await asyncio.to_thread(deleter.join, 360)
            return results, time.monotonic() - begun

    results, drained_s = asyncio.run(run())
    assert deleted.is_set(), "serve.delete did not return"
    print(f"\ndrain: {len(results)} in-flight requests finished, delete took {drained_s:.0f} s")
    assert results == [("length", MAX_TOKENS, True)] * len(results), results
    after = httpx.post(f"{url}/v1/chat/completions", json=_body(0, False), timeout=30)
    assert after.status_code == 404, "a deleted app still answers"
