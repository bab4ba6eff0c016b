"""Operating a fleet on the real stack: two engine replicas, then bugs, saturation, a hung engine
and a killed replica.

One small app for the module: two SmolLM2 engine replicas of 2 sequences each (so requests
queue inside them), health checks every second, an 8 s stall timeout, SSE keep-alives every
0.5 s, and the test-only fault hook on. Timings are loose bounds that separate "fails fast"
from "hangs until request_timeout_s" (300 s here); nothing depends on how fast this box is.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest
from openai import AsyncOpenAI

from tests.serve.conftest import MODEL
from tests.serve.test_scale_survive import _deploy, _replica_pids

APP = "fleet"
FLEET: dict[str, Any] = {
    "engine": {
        "num_replicas": 2,
        "kv_cache_space_gib": 1,
        "num_cpus": 0.1,
        "max_num_seqs": 2,
        "max_ongoing_requests": 6,
        "health_check_period_s": 1,
        "health_check_timeout_s": 30,
        "stall_timeout_s": 8,
    },
    "router": {"num_cpus": 0.05},
    "preprocessor": {"num_cpus": 0.05},
    "request_timeout_s": 300,
    "engine_wait_timeout_s": 120,
    "sse_keepalive_s": 0.5,
    "fault_injection": True,
}
FAILS_FAST_S = 90  # Well under request_timeout_s: a failure after this would be a hang.


@pytest.fixture(scope="module")
def fleet(base_url: str) -> Iterator[str]:
    from ray import serve

    url = _deploy(base_url, APP, FLEET)
    _wait_engines(2)
    yield url
    serve.delete(APP)


def _running_engines() -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    status = serve.status().applications[APP].deployments["Engine"]
    return int(status.replica_states.get(ReplicaState.RUNNING, 0))


def _wait_engines(count: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while _running_engines() != count or len(_replica_pids(APP, "Engine")) != count:
        assert time.monotonic() < deadline, f"not {count} running engine replicas"
        time.sleep(1)


def _wait_requests_in(pid: int, count: int, timeout_s: float = 240) -> None:
    """Until the Engine replica in process ``pid`` holds ``count`` requests, as it tells Serve's
    request router (the replica actor's own probe, which takes no request slot); on a slow,
    busy machine the assignment of queued requests takes its time."""
    import ray
    from ray._private.state import actors

    alive = (a for a in actors().values() if a["State"] == "ALIVE")
    name = next(a["Name"] for a in alive if int(a["Pid"]) == pid)
    replica = ray.get_actor(name, namespace="serve")
    deadline = time.monotonic() + timeout_s
    while (held := ray.get(replica.get_num_ongoing_requests.remote(), timeout=30)) < count:
        assert time.monotonic() < deadline, f"replica {pid} holds {held} requests, not {count}"
        time.sleep(0.2)


def _body(max_tokens: int, i: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Tell a story about ship {i}."}],
        **extra,
    }


@dataclass
class Stream:
    """What one client saw of an SSE answer."""

    tokens: int = 0
    error: dict[str, Any] | None = None
    error_before_content: bool = False
    done: bool = False
    keepalives: int = 0
    keepalives_before_content: int = 0
    ended: float = 0.0
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def _stream(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], seen: Stream | None = None
) -> Stream:
    seen = seen or Stream()
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith(":"):
                seen.keepalives += 1
                seen.keepalives_before_content += not seen.started.is_set()
            elif line == "data: [DONE]":
                seen.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    seen.error = chunk["error"]
                    seen.error_before_content = not seen.started.is_set()
                for choice in chunk.get("choices") or []:
                    if choice["delta"].get("content"):
                        seen.started.set()
                if chunk.get("usage"):
                    seen.tokens = chunk["usage"]["completion_tokens"]
    seen.ended = time.monotonic()
    return seen


async def _plain(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await http.post(f"{url}/v1/chat/completions", json=body)
    return response.status_code, response.json()


async def _balanced_streams(http: httpx.AsyncClient, url: str, n: int, max_tokens: int) -> Any:
    """``n`` streams, each started once the previous one produced content: with two replicas
    Serve's power-of-two routing then puts them alternately on the less busy one."""
    tasks = []
    for i in range(n):
        seen = Stream()
        tasks.append(asyncio.create_task(_stream(http, url, _body(max_tokens, i), seen)))
        started = asyncio.create_task(seen.started.wait())
        await asyncio.wait({started, tasks[-1]}, timeout=240, return_when="FIRST_COMPLETED")
        started.cancel()
        assert seen.started.is_set(), "a stream produced no content"
    return tasks


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _core_of(replica_pid: int) -> psutil.Process:
    children = psutil.Process(replica_pid).children(recursive=True)
    (core,) = [p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    return core


def test_a_bug_is_500_internal_error_and_fails_only_its_request(fleet: str) -> None:
    bug = _body(4, 0, stop=["serve_app-fault:engine"])
    for stream in (False, True):
        response = httpx.post(f"{fleet}/v1/chat/completions", json=bug | {"stream": stream})
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "internal_error"
        assert "retry-after" not in response.headers  # Not "busy": clients must not retry.
        assert response.headers["x-should-retry"] == "false"  # The openai SDK obeys this.

    async def window() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(timeout=120) as http:
            bodies = [_body(2, i) for i in range(6)]
            bodies[3] = bodies[3] | {"stop": ["serve_app-fault:preprocess"]}
            return await asyncio.gather(*(_plain(http, fleet, body) for body in bodies))

    results = asyncio.run(window())
    assert [status for status, _ in results] == [200, 200, 200, 500, 200, 200], results
    assert results[3][1]["error"]["code"] == "internal_error"


def test_saturated_app_stays_ready_and_waiting_streams_get_keepalives(fleet: str) -> None:
    """16 requests on 2 x 2 engine slots (and 2 x 6 replica places): requests queue in the
    engines and in the router's handle. /health answers 200 throughout; a stream that waits
    gets SSE comment lines, which the openai SDK skips."""

    async def run() -> tuple[list[int], list[Stream], str]:
        async with httpx.AsyncClient(timeout=240) as http:
            fillers = [asyncio.create_task(_stream(http, fleet, _body(48, i))) for i in range(14)]
            await asyncio.sleep(1)
            waiting = asyncio.create_task(_stream(http, fleet, _body(4, 99)))
            sdk = AsyncOpenAI(base_url=f"{fleet}/v1", api_key="x", max_retries=0, timeout=240)
            chunks = await sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Say hi."}],
                max_tokens=4,
                stream=True,
            )
            text_task = asyncio.create_task(_text(chunks))
            health: list[int] = []
            while not all(t.done() for t in [*fillers, waiting]):
                health.append((await http.get(f"{fleet}/health")).status_code)
                await asyncio.sleep(0.3)
            return health, [await t for t in [*fillers, waiting]], await text_task

    health, streams, text = asyncio.run(run())
    assert health and set(health) == {200}, health
    assert all(s.done and s.error is None for s in streams)
    assert streams[-1].keepalives_before_content >= 1, streams[-1]
    assert text  # The SDK read through the keep-alives.


async def _text(chunks: Any) -> str:
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


def test_hung_engine_fails_fast_and_is_replaced(fleet: str) -> None:
    _wait_engines(2)
    replicas = _replica_pids(APP, "Engine")
    hung_replica = replicas[0]
    core = _core_of(hung_replica)

    async def run() -> tuple[list[Stream], list[tuple[int, Any]], float]:
        async with httpx.AsyncClient(timeout=280) as http:
            streams = await _balanced_streams(http, fleet, 4, max_tokens=160)  # 2 per replica.
            os.kill(core.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            plain = [_plain(http, fleet, _body(8, 50 + i)) for i in range(2)]
            results = await asyncio.gather(*plain)
            return [await t for t in streams], list(results), stopped

    streams, plain, stopped = asyncio.run(run())
    failed = [s for s in streams if s.error is not None]
    # The 2 streams on the hung engine end with an OpenAI error event, fast; the others finish.
    assert len(failed) == 2, streams
    for s in failed:
        assert s.error is not None and s.error["code"] in {
            "engine_unavailable",
            "backend_unavailable",
        }
        assert not s.error_before_content and s.done and s.ended - stopped < FAILS_FAST_S
    assert all(s.tokens == 160 for s in streams if s.error is None)
    for status, body in plain:  # Re-submitted (200) or refused at once (503), never stuck.
        assert status == 200 or (status == 503 and body["error"]["code"].endswith("unavailable"))
    # The hung core is killed (a stopped process outlives SIGTERM) and the replica exits a
    # moment after failing its requests; then Serve replaces it.
    deadline = time.monotonic() + 600
    while not _gone(core) or hung_replica in _replica_pids(APP, "Engine"):
        assert time.monotonic() < deadline, f"hung core gone: {_gone(core)}, replica not replaced"
        time.sleep(1)
    _wait_engines(2)
    ok = httpx.post(f"{fleet}/v1/chat/completions", json=_body(4, 7), timeout=120)
    assert ok.status_code == 200, ok.text


def test_killed_replica_loses_no_request_that_had_not_started(fleet: str) -> None:
    from ray import serve

    _wait_engines(2)
    router = serve.get_deployment_handle("Router", app_name=APP)
    before = router.fleet_stats.remote().result()["resubmits"]
    victim = _replica_pids(APP, "Engine")[0]

    async def run() -> tuple[list[Stream], list[tuple[int, Any]]]:
        async with httpx.AsyncClient(timeout=280) as http:
            running = await _balanced_streams(http, fleet, 4, max_tokens=96)  # Slots full.
            queued = [
                asyncio.create_task(_stream(http, fleet, _body(24, 20 + i))) for i in range(2)
            ]
            plain = [asyncio.create_task(_plain(http, fleet, _body(24, 30 + i))) for i in range(6)]
            # Kill once the victim holds requests beyond its 2 slots (queued in its engine).
            await asyncio.to_thread(_wait_requests_in, victim, 4)
            os.kill(victim, signal.SIGKILL)
            streams = [await t for t in [*running, *queued]]
            return streams, [await t for t in plain]

    streams, plain = asyncio.run(run())
    assert [status for status, _ in plain] == [200] * 6, plain
    assert all(body["usage"]["completion_tokens"] == 24 for _, body in plain)
    for s in streams:  # Complete, or an error event after content (it was mid-generation).
        assert s.done and not s.error_before_content, s
        if s.error is not None:
            assert s.error["code"] == "backend_unavailable" and s.tokens > 0
        else:
            assert s.tokens in (96, 24)
    assert sum(s.error is not None for s in streams) <= 2  # Only the victim's running ones.
    resubmits = router.fleet_stats.remote().result()["resubmits"] - before
    print(f"\nkilled replica: {resubmits} requests re-submitted, all succeeded")
    assert resubmits >= 1
