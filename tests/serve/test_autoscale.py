"""Autoscaling on the engine's queue depth, on the real stack: the queue-depth policy scales a
real engine 1 -> 2 -> 1 under load, and keeps Serve's up/down delays (on a stand-in whose
queue depth the test sets).

Its own module so that no other test app (the scale-and-survive one) holds memory while two
engines of its own run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx

from tests.serve.test_scale_survive import SURVIVE, _body, _deploy


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

                await asyncio.gather(*(worker(i) for i in range(8)))

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


class QueueStandIn:
    """An engine stand-in for the autoscaler: reports the queue depth written to a file."""

    def __init__(self, depth_file: str) -> None:
        self.depth_file = depth_file

    def record_autoscaling_stats(self) -> dict[str, float]:
        from serve_app.config.autoscaling import QUEUE_METRIC

        with open(self.depth_file) as file:
            return {QUEUE_METRIC: float(file.read())}

    def ping(self) -> str:
        return "ok"


def test_queue_policy_keeps_its_up_and_down_delays(base_url: str, tmp_path: Any) -> None:
    """The engine's own policy (EngineQueuePolicy, Serve's delay wrapper around it) with the
    config's autoscaling_config, on a stand-in that reports a queue depth we set: no upscale
    before upscale_delay_s of queue above target, none down before downscale_delay_s empty."""
    from ray import serve

    from serve_app.config.autoscaling import (
        EngineAutoscalingConfig,
        autoscaling_config,
        replica_env,
    )

    up_s, down_s = 3.0, 6.0
    auto = EngineAutoscalingConfig(
        target_queue_depth=4,
        upscale_delay_s=up_s,
        downscale_delay_s=down_s,
        look_back_period_s=1,
        metrics_interval_s=0.5,
    )
    depth = tmp_path / "depth"
    depth.write_text("0")
    deployment = serve.deployment(
        QueueStandIn,
        name="Engine",
        ray_actor_options={"num_cpus": 0.01, "runtime_env": {"env_vars": replica_env(auto)}},
        autoscaling_config=autoscaling_config(
            auto, min_replicas=1, max_replicas=3, target_ongoing=16
        ),
        graceful_shutdown_timeout_s=1,
    )
    handle = serve.run(deployment.bind(str(depth)), name="delays", route_prefix=None)

    def replicas() -> int:  # Wanted ones: everything but those stopping.
        states = serve.status().applications["delays"].deployments["Engine"].replica_states
        return sum(n for state, n in states.items() if "STOPPING" not in str(state))

    def watch(condition: Any, seconds: float) -> float | None:
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            if condition():
                return time.monotonic() - started
            time.sleep(0.1)
        return None

    try:
        assert handle.ping.remote().result(timeout_s=60) == "ok"
        assert watch(lambda: replicas() != 1, 3) is None  # Idle at min_replicas.
        depth.write_text("10")  # 10 per replica, target 4: wants 3.
        early = watch(lambda: replicas() > 1, up_s - 0.1)
        assert early is None, f"scaled up {early:.1f} s into a {up_s} s upscale delay"
        assert watch(lambda: replicas() == 3, 60) is not None, "no upscale"
        assert watch(lambda: _running("delays") == 3, 120) is not None
        time.sleep(1.5)  # Every replica has reported.
        depth.write_text("0")
        early = watch(lambda: replicas() < 3, down_s - 0.1)
        assert early is None, f"scaled down {early:.1f} s into a {down_s} s downscale delay"
        assert watch(lambda: replicas() == 1, 60) is not None, "no downscale"
    finally:
        serve.delete("delays")


def _running(app: str) -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    states = serve.status().applications[app].deployments["Engine"].replica_states
    return int(states.get(ReplicaState.RUNNING, 0))
