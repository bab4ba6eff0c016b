"""Scale and survive: backpressure, timeouts, engine death and recovery, autoscaling.

Each part deploys its own small app next to the shared one (tight limits so a burst overflows)
and deletes it at the end. Every client call is bounded; timings are generous (shared CPUs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from serve_app.launch import _merge, load_serve_config, wait_ready
from tests.serve.conftest import MODEL, ROOT

SURVIVE: dict[str, Any] = {
    "engine": {
        "kv_cache_space_gib": 1,
        "num_cpus": 0.1,
        "max_ongoing_requests": 4,
        "max_queued_requests": 4,
        "health_check_period_s": 2,
        "health_check_timeout_s": 20,
        "graceful_shutdown_timeout_s": 5,
        "stall_timeout_s": 6,  # Well under request_timeout_s: a hung engine is a 503, not a 504.
    },
    # The router takes more than the engine: overload is shed at the engine's handle (OpenAI
    # JSON); past the router's own queue Serve's proxy rejects (plain text, Retry-After). That
    # queue also holds requests not yet assigned (slow on busy CPUs): it must cover a burst.
    "router": {"num_cpus": 0.05, "max_ongoing_requests": 64, "max_queued_requests": 48},
    "preprocessor": {"num_cpus": 0.05},
    "request_timeout_s": 15,
    "engine_wait_timeout_s": 4,
    "batch_api": {"enabled": False},  # Not under test here: one process less on 2 cores.
}


def _deploy(base_url: str, name: str, overrides: dict[str, Any]) -> str:
    from ray import serve

    from serve_app import build_app

    args = load_serve_config(ROOT / "serve_config.cpu.yaml")["applications"][0]["args"]
    serve.run(
        build_app(_merge(args, overrides)), name=name, route_prefix=f"/{name}", blocking=False
    )
    url = f"{base_url}/{name}"
    wait_ready(url, timeout_s=600)
    return url


def _replica_pids(app: str, deployment: str) -> list[int]:
    from ray._private.state import actors  # GCS directly: several Ray clusters may run here.

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [
        int(a["Pid"])
        for a in actors().values()
        if a["State"] == "ALIVE" and str(a["Name"]).startswith(prefix)
    ]


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def _unfinished(app: str) -> int:
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name=app)
    return int(handle.num_unfinished.remote().result(timeout_s=30))


def _body(max_tokens: int, i: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"Count to ten, please ({i})."}],
        **extra,
    }


@pytest.fixture(scope="module")
def survive(base_url: str) -> Iterator[str]:
    from ray import serve

    try:
        yield _deploy(base_url, "survive", SURVIVE)
    finally:  # Also when the deploy or a test failed.
        serve.delete("survive")


async def _one(http: httpx.AsyncClient, url: str, i: int) -> tuple[int, dict[str, str], str]:
    body = _body(8, i, stream=i % 3 == 0)
    response = await http.post(f"{url}/v1/chat/completions", json=body)
    return response.status_code, dict(response.headers), response.text


def _burst(url: str, n: int) -> list[tuple[int, dict[str, str], str]]:
    async def run() -> list[tuple[int, dict[str, str], str]]:
        async with httpx.AsyncClient(timeout=90) as http:
            return await asyncio.gather(*(_one(http, url, i) for i in range(n)))

    return asyncio.run(run())


def _check_rejections(results: list[tuple[int, dict[str, str], str]]) -> tuple[int, int]:
    """(rejected, of which plain text); every status is 200, 429 or 503 with Retry-After."""
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    plain = 0
    for status, headers, text in results:
        if status == 200:
            continue
        assert headers.get("retry-after", "").isdigit(), (status, headers, text)
        try:
            assert "message" in json.loads(text)["error"]
        except (ValueError, KeyError):
            plain += 1  # Serve's proxy rejecting at the router's own queue: plain text.
            if plain == 1:
                print(f"\nproxy rejection: {status} {text[:120]!r}")
    return len(results) - statuses.count(200), plain


def test_overload_burst_gets_200_or_backpressure(survive: str) -> None:
    pids = _replica_pids("survive", "Router") + _replica_pids("survive", "Engine")
    assert len(pids) == 2
    _burst(survive, 8)  # Warm-up: first-use allocations are not leaks.
    before = _rss(pids)
    results = _burst(survive, 40) + _burst(survive, 40)
    after = _rss(pids)
    rejected, plain = _check_rejections(results)
    ok = len(results) - rejected
    assert ok >= 4 and rejected, f"{ok} ok, {rejected} rejected"
    assert plain == 0, "within the router's capacity every rejection is OpenAI JSON"
    over_rejected, over_plain = _check_rejections(_burst(survive, 160))
    print(f"\nburst 2x40: {ok} ok, {rejected} rejected (OpenAI JSON, 503 + Retry-After)")
    print(f"burst 160: {over_rejected} rejected, {over_plain} by the proxy (plain text)")
    print(f"RSS router+engine: {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB")
    assert after < before * 1.3 + 300 * 2**20


def test_timeout_is_504_and_aborts_engine_work(survive: str) -> None:
    long = _body(4000, ignore_eos=True)
    started = time.monotonic()
    response = httpx.post(f"{survive}/v1/chat/completions", json=long, timeout=60)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "timeout"
    assert elapsed < 40
    with httpx.stream(
        "POST", f"{survive}/v1/chat/completions", json=long | {"stream": True}, timeout=60
    ) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "timeout"
    deadline = time.monotonic() + 10
    while _unfinished("survive") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _unfinished("survive") == 0


def _engine_core(app: str) -> psutil.Process:
    (pid,) = _replica_pids(app, "Engine")
    children = psutil.Process(pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    assert cores, [(p.pid, p.name()) for p in children]
    return cores[0]


def test_engine_death_fails_fast_and_recovers(survive: str) -> None:
    assert httpx.get(f"{survive}/health", timeout=10).status_code == 200
    core = _engine_core("survive")

    async def load() -> list[int | str]:
        async with httpx.AsyncClient(timeout=60) as http:

            async def call(i: int) -> int | str:
                try:
                    body = _body(400, i, ignore_eos=True)
                    r = await http.post(f"{survive}/v1/chat/completions", json=body)
                    return r.status_code
                except httpx.TimeoutException:
                    return "hang"

            tasks = [asyncio.create_task(call(i)) for i in range(6)]
            await asyncio.sleep(3)
            os.kill(core.pid, signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

    killed_at = time.monotonic()
    statuses = asyncio.run(load())
    assert "hang" not in statuses, statuses
    assert set(statuses) <= {200, 503}, statuses
    recovered_after = _await_recovery(survive, killed_at)
    print(f"\nin-flight at kill: {statuses}; recovered after {recovered_after:.0f} s")
    assert _engine_core("survive").pid != core.pid


def _await_recovery(url: str, since: float) -> float:
    """Seconds from ``since`` until a request succeeds again; 503s (never a hang) meanwhile,
    and readiness said 503 at least once (the replica was replaced, not just retried)."""
    seen_unhealthy = False
    while time.monotonic() - since < 420:
        seen_unhealthy |= httpx.get(f"{url}/health", timeout=10).status_code == 503
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=_body(4), timeout=30)
        except httpx.TimeoutException:
            pytest.fail("a request hung past its client timeout during recovery")
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            assert seen_unhealthy
            recovered = time.monotonic() - since
            # Readiness is cached controller state (2 s): it follows within a few seconds.
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/health", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, "readiness stayed 503 after recovery"
                time.sleep(0.5)
            return recovered
        time.sleep(1)
    pytest.fail("the engine replica never came back")


def test_hung_engine_fails_fast_and_is_replaced(survive: str) -> None:
    """SIGSTOP the engine core: alive, hung, every process check passes. With requests in
    flight and no engine step for stall_timeout_s (6 s) they get 503 engine_unavailable, not
    the 504 of request_timeout_s (15 s); the hung core is killed and Serve replaces the replica."""
    assert httpx.get(f"{survive}/health", timeout=10).status_code == 200
    core = _engine_core("survive")

    async def load() -> list[tuple[int, str] | str]:
        async with httpx.AsyncClient(timeout=60) as http:

            async def call(i: int) -> tuple[int, str] | str:
                try:
                    body = _body(1500, i, ignore_eos=True)
                    r = await http.post(f"{survive}/v1/chat/completions", json=body)
                except httpx.TimeoutException:
                    return "hang"
                return r.status_code, r.json().get("error", {}).get("code", "")

            tasks = [asyncio.create_task(call(i)) for i in range(4)]
            await asyncio.sleep(2)
            os.kill(core.pid, signal.SIGSTOP)
            return list(await asyncio.gather(*tasks))

    stopped_at = time.monotonic()
    try:
        results = asyncio.run(load())
    finally:
        with contextlib.suppress(psutil.Error):
            if core.is_running():  # Only if the watchdog failed: leave nothing stopped behind.
                core.kill()
    print(f"\nin flight at SIGSTOP: {results}")
    assert "hang" not in results, results
    # engine_unavailable, or backend_unavailable for a request resubmitted (nothing was sent to
    # the client yet) after Serve took the failed replica out of rotation.
    lost = {(503, "engine_unavailable"), (503, "backend_unavailable")}
    assert set(results) & lost and set(results) <= lost | {(200, "")}, results
    deadline = time.monotonic() + 30
    while psutil.pid_exists(core.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(core.pid), "the hung engine core was not killed"
    recovered_after = _await_recovery(survive, stopped_at)
    print(f"hung core killed; recovered after {recovered_after:.0f} s")
    assert _engine_core("survive").pid != core.pid


def _engine_replicas(app: str) -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    status = serve.status().applications[app].deployments["Engine"]
    return int(status.replica_states.get(ReplicaState.RUNNING, 0))


def test_autoscales_on_engine_queue(base_url: str) -> None:
    from ray import serve

    overrides = {
        "engine": SURVIVE["engine"]
        | {
            "max_ongoing_requests": 32,
            "max_queued_requests": -1,
            "num_replicas": "auto",
            "min_replicas": 1,
            "max_replicas": 2,
            "autoscaling": {
                "target_queue_depth": 2,
                "upscale_delay_s": 1,
                "downscale_delay_s": 5,
                "look_back_period_s": 2,
                "metrics_interval_s": 0.5,
            },
        },
        "router": {"num_cpus": 0.05},
        "preprocessor": {"num_cpus": 0.05},
        "batch_api": SURVIVE["batch_api"],
    }
    url = _deploy(base_url, "autoscale", overrides)
    try:
        assert _engine_replicas("autoscale") == 1

        stop = threading.Event()

        async def load() -> None:
            async with httpx.AsyncClient(timeout=120) as http:

                async def worker(i: int) -> None:
                    while not stop.is_set():
                        body = _body(64, i, ignore_eos=True)
                        await http.post(f"{url}/v1/chat/completions", json=body)

                # 4 in flight hold the queue past 2 replicas x target 2; more only slows the
                # second replica's start on 2 cores.
                await asyncio.gather(*(worker(i) for i in range(4)))

        loader = threading.Thread(target=asyncio.run, args=(load(),))
        started = time.monotonic()
        loader.start()
        while _engine_replicas("autoscale") < 2 and time.monotonic() - started < 300:
            time.sleep(1)
        up_after = time.monotonic() - started
        stop.set()
        loader.join(timeout=150)
        assert _engine_replicas("autoscale") == 2, "no scale-up within 300 s"
        idle_at = time.monotonic()
        while _engine_replicas("autoscale") > 1 and time.monotonic() - idle_at < 180:
            time.sleep(1)
        down_after = time.monotonic() - idle_at
        print(
            f"\nautoscale: 1 -> 2 after {up_after:.0f} s load, 2 -> 1 after {down_after:.0f} s idle"
        )
        assert _engine_replicas("autoscale") == 1, "no scale-down within 180 s"
    finally:
        serve.delete("autoscale")
